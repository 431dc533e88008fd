"""Python code run in fresh processes forked from one that imported TF once.

A docs block or a binary must run as written in a process of its own;
starting Python for each costs TensorFlow's import (about 4 CPU seconds).
`Server` imports TensorFlow once and forks a child per request: the child
runs a piece of code (as `python -c` would) or a main module with its argv
and environment (as `python -m` would), its output in files of its own, and
exits with the code's exit code.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

# The server: one request (JSON) per stdin line; per request, the child's pid
# and then its exit code, one stdout line each. TensorFlow is imported and
# nothing else is built before a fork: no session, no thread pool of
# TensorFlow's for a child to inherit half of. A module request's child
# returns from `_serve` and ends as the interpreter of `python -m` would
# (atexit handlers, non-daemon threads joined, streams flushed).
_SERVER = r"""
import gc, json, os, runpy, sys, traceback
from absl import app, flags, logging  # What a binary imports before parsing.
_BEFORE_TF = set(flags.FLAGS)
import numpy
import tensorflow
# Out of the children's collections: a child ending as a process does would
# otherwise touch (and so copy) every object of TensorFlow's, about 1 CPU s.
gc.freeze()
# Flags TensorFlow defines when imported. A binary imports TensorFlow after
# parsing its flags: hide them while it parses, add them back after.
_TF_FLAGS = {n: flags.FLAGS[n] for n in set(flags.FLAGS) - _BEFORE_TF}


def _parse_then_add_tf_flags(parse):
  def wrapped(self, *args, **kwargs):
    rest = parse(self, *args, **kwargs)
    if self is flags.FLAGS:
      for name, flag in _TF_FLAGS.items():
        if name not in self:
          self[name] = flag
    return rest
  return wrapped


def _code_child(request):
  sys.argv = ["-c"]
  code = 0
  try:
    exec(compile(request["code"], "<string>", "exec"),
         {"__name__": "__main__", "__builtins__": __builtins__})
  except SystemExit as e:  # As python -c: sys.exit("why") says why.
    code = e.code if isinstance(e.code, int) or e.code is None else 1
    if code == 1 and not isinstance(e.code, int):
      print(e.code, file=sys.stderr)
    code = code or 0
  except BaseException:  # As python -c: the traceback, exit 1.
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _module_child(request):
  os.environ.clear()
  os.environ.update(request["env"])
  numpy.random.seed()  # A fresh process's global RNG is seeded afresh.
  for name in _TF_FLAGS:
    delattr(flags.FLAGS, name)
  flags.FlagValues.__call__ = _parse_then_add_tf_flags(
      flags.FlagValues.__call__)
  sys.argv = [request["module"]] + request["argv"]
  runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
  sys.exit(0)


def _serve():
  for request_line in sys.stdin:
    request = json.loads(request_line)
    pid = os.fork()
    if pid == 0:
      os.setpgid(0, 0)  # A timeout kills the child and what it started.
      for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
      os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
      os.chdir(request["cwd"])
      return request
    try:
      os.setpgid(pid, pid)
    except OSError:  # The child did it first, or is gone.
      pass
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
  return None


_request = _serve()
if _request is not None:
  if "code" in _request:
    _code_child(_request)
  else:
    _module_child(_request)
"""


class Server(object):
  """A process that runs code in children forked after TF's import."""

  def __init__(self, env):
    """Starts the server with environment `env` (its children's)."""
    self._process = subprocess.Popen(
        [sys.executable, "-c", _SERVER], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, start_new_session=True)
    self._buffer = b""  # What the server wrote to stdout, not yet read.
    self._child = None  # The pid of the running child, if any.
    self._lock = threading.Lock()  # One request at a time.

  def run(self, code, cwd, timeout):
    """Runs `code` in a child; returns a `subprocess.CompletedProcess`.

    Args:
      code: Python source, as for `python -c`.
      cwd: the child's working directory.
      timeout: seconds before `subprocess.TimeoutExpired` is raised (and the
        child killed).
    """
    return self._request({"code": code, "cwd": cwd},
                         ["forked_python", code], timeout)

  def run_module(self, module, argv, env, cwd, timeout):
    """Runs main module `module` in a child, as `python -m` would.

    Args:
      module: e.g. "tf1_safe_train.train".
      argv: its arguments (after sys.argv[0], its file).
      env: the child's whole environment (set before the module runs).
      cwd: the child's working directory.
      timeout: seconds before `subprocess.TimeoutExpired` is raised (and the
        child and its process group killed).

    Returns:
      A `subprocess.CompletedProcess`, stdout and stderr as text.
    """
    return self._request(
        {"module": module, "argv": list(argv), "env": dict(env), "cwd": cwd},
        ["forked_python", "-m", module] + list(argv), timeout)

  def _request(self, request, args, timeout):
    with self._lock, tempfile.TemporaryDirectory() as directory:
      out, err = (os.path.join(directory, name) for name in ("out", "err"))
      request.update(stdout=out, stderr=err)
      self._process.stdin.write(json.dumps(request).encode() + b"\n")
      self._process.stdin.flush()
      pid = self._child = int(self._read_line(timeout))
      code = self._read_line(timeout, or_none=True)
      if code is None:
        try:
          os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        self._read_line(60)  # The killed child's exit code.
        self._child = None
        raise subprocess.TimeoutExpired(args, timeout)
      self._child = None
      outputs = []
      for path in (out, err):
        with open(path) as f:
          outputs.append(f.read())
    return subprocess.CompletedProcess(args, int(code), *outputs)

  def _read_line(self, timeout, or_none=False):
    """The server's next stdout line; after `timeout` seconds None if
    `or_none`, else the server is deemed hung (closed, RuntimeError)."""
    # Read unbuffered: a buffered reader could hold the next line where
    # select() does not see it.
    deadline = time.monotonic() + timeout
    fd = self._process.stdout.fileno()
    while b"\n" not in self._buffer:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        if or_none:
          return None
        self.close()
        raise RuntimeError("the forked_python server hangs")
      chunk = os.read(fd, 4096)
      if not chunk:
        raise RuntimeError("the forked_python server died (exit %s)" %
                           self._process.wait())
      self._buffer += chunk
    line, self._buffer = self._buffer.split(b"\n", 1)
    return line.decode()

  def close(self):
    """Ends the server and any child of it still running."""
    for group in (self._child, self._process.pid):
      try:
        if group is not None:
          os.killpg(group, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self._process.wait()
    self._process.stdin.close()
    self._process.stdout.close()


_SHARED = []


def run_shared(code, cwd, timeout=300):
  """Runs `code` as `python -c` would, in a child of this process's one
  shared `Server` (started on first use: this environment with
  TF_CPP_MIN_LOG_LEVEL=2, this process's `sys.path`); `close_shared` ends
  it (a test module's `tearDownModule`)."""
  if not _SHARED:
    _SHARED.append(Server(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                               PYTHONPATH=os.pathsep.join(sys.path))))
  return _SHARED[0].run(code, cwd, timeout=timeout)


def close_shared():
  while _SHARED:
    _SHARED.pop().close()
