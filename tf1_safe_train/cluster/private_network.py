"""A network namespace of its own for this process and its children (Linux)."""

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct

_CLONE_NEWUSER = 0x10000000  # From <sched.h>.
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913  # From <linux/sockios.h>.
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def isolate():
  """Moves this process into a network namespace of its own (Linux).

  TensorFlow's gRPC servers listen on every interface ("0.0.0.0:PORT"; the
  ServerDef has no bind address) and run any graph they are sent,
  unauthenticated. In a namespace whose only interface is its own loopback,
  the tasks reach each other on 127.0.0.1 and nobody else reaches them.
  Unprivileged users get the namespace through a user namespace that maps
  their own uid and gid to themselves. Must run before any thread starts.

  Returns:
    None if isolated, else why not (one line).
  """
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                       use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
      uid, gid = os.getuid(), os.getgid()
      if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return os.strerror(ctypes.get_errno())
      for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (
          uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
          f.write(text)
    _loopback_up()
  except (OSError, AttributeError) as e:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
  return None


def _loopback_up():
  """Brings up `lo` (a new network namespace starts with it down)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = bytearray(struct.pack("16sH", b"lo", 0).ljust(40, b"\0"))
    fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request)
    flags = struct.unpack_from("H", request, 16)[0] | _IFF_UP
    struct.pack_into("H", request, 16, flags)
    fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, request)
