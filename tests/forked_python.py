"""Python code run in fresh processes forked from one that imported TF once.

A docs block must run as written in a process of its own; starting Python
for each costs TensorFlow's import (about 4 CPU seconds). `Server` imports
TensorFlow once and forks a child per piece of code: the child runs it in a
fresh `__main__` namespace, its output in files of its own, and exits with
the code's exit code, as `python -c` would.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile

# The server: one request (JSON) per stdin line, one exit code per stdout
# line. TensorFlow is imported and nothing else is built before a fork: no
# session, no thread pool of TensorFlow's for a child to inherit half of.
_SERVER = r"""
import json, os, sys, traceback
import tensorflow

for request_line in sys.stdin:
  request = json.loads(request_line)
  pid = os.fork()
  if pid == 0:
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
      os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
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
  _, status = os.waitpid(pid, 0)
  print(os.waitstatus_to_exitcode(status), flush=True)
"""


class Server(object):
  """A process that runs code in children forked after TF's import."""

  def __init__(self, env):
    """Starts the server with environment `env` (its children's)."""
    self._process = subprocess.Popen(
        [sys.executable, "-c", _SERVER], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, start_new_session=True)

  def run(self, code, cwd, timeout):
    """Runs `code` in a child; returns a `subprocess.CompletedProcess`.

    Args:
      code: Python source, as for `python -c`.
      cwd: the child's working directory.
      timeout: seconds before `subprocess.TimeoutExpired` is raised (and the
        server killed).
    """
    with tempfile.TemporaryDirectory() as directory:
      out, err = (os.path.join(directory, name) for name in ("out", "err"))
      self._process.stdin.write(json.dumps(
          {"code": code, "cwd": cwd, "stdout": out, "stderr": err}) + "\n")
      self._process.stdin.flush()
      ready, _, _ = select.select([self._process.stdout], [], [], timeout)
      if not ready:
        self.close()
        raise subprocess.TimeoutExpired(["forked_python", code], timeout)
      line = self._process.stdout.readline()
      if not line:
        raise RuntimeError("the forked_python server died (exit %s)" %
                           self._process.wait())
      outputs = []
      for path in (out, err):
        with open(path) as f:
          outputs.append(f.read())
    return subprocess.CompletedProcess(["forked_python", code], int(line),
                                       *outputs)

  def close(self):
    """Ends the server and any child of it still running."""
    try:
      os.killpg(self._process.pid, signal.SIGKILL)
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
