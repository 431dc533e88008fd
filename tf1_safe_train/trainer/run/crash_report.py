"""One line instead of a thread dump when TensorFlow's native code crashes.

TensorFlow 2.21's oneDNN kernels (the default on x86 CPUs) do not stop when
an allocation fails: `MklConvOp` reports RESOURCE_EXHAUSTED and then reads
the tensor it could not allocate, a segmentation fault in a compute thread.
So a step too large for memory (e.g. `--batch_size=100000`) ends in
SIGSEGV, not in a `ResourceExhaustedError` Python could catch (with
TF_ENABLE_ONEDNN_OPTS=0 it is a clean error). Nothing can continue after
that, but the user gets one line naming the likely cause instead of
Python's fault-handler thread dump (which goes to a file, for a real bug).

The handler is installed with libc's `signal` through ctypes: it runs in the
crashing thread, takes the GIL (the other threads wait in TensorFlow, which
releases it), writes the line and ends the process.
"""

import ctypes
import faulthandler
import os
import signal
import tempfile

_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int)
_FATAL_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
_installed = []  # The ctypes callbacks must outlive install().


def install(program, likely_cause):
  """Reports a fatal signal as `<program>: error: ...` and exits 1.

  Args:
    program: the binary's name.
    likely_cause: text of the line after "TensorFlow crashed (SIGSEGV)",
      e.g. what to change.

  Returns:
    True if installed (Linux with a libc), else False.
  """

  def handle(signum):
    dump = os.path.join(tempfile.gettempdir(),
                        "%s_crash_%d.txt" % (program, os.getpid()))
    try:
      with open(dump, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
    except OSError:
      dump = None
    line = "%s: error: TensorFlow crashed (%s) %s%s\n" % (
        program, signal.Signals(signum).name, likely_cause,
        "; thread dump in %s" % dump if dump else "")
    try:
      os.write(2, line.encode("utf-8", "replace"))
    finally:
      os._exit(1)  # pylint: disable=protected-access

  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, _HANDLER_TYPE]
  except (OSError, AttributeError):
    return False
  callback = _HANDLER_TYPE(handle)
  _installed.append(callback)
  for signum in _FATAL_SIGNALS:
    libc.signal(signum, callback)
  return True
