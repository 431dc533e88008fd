"""The trainer as a running process, forked from a server that imported TF.

`reliability_lib.start_trainer` starts `//:train` afresh, TensorFlow's import
(about 4 CPU s) included, for each run a test signals or kills mid-run.
`Server.start` forks the same run from a `forked_python.Server` instead (one
import per server) and returns at once a handle like `subprocess.Popen`'s:
its pid, which is also its process group (so `reliability_lib.send` and
`kill_and_reap` work), `poll`, `wait`, `returncode`. `start_code` does the
same for a driver script run as `python -c` with arguments. The child runs
as `binaries.run`'s forked runs do (tests/binaries.py says what such a run
proves and what it does not: start-up before TensorFlow's import is not
exercised, so tests of a signal during start-up start the binary afresh).
A child inherits the server's SIGINT disposition (ignored when the tests run
as a shell's background job); the trainer installs its own SIGTERM and
SIGINT handlers when its session starts, so a signal mid-run is handled as
in a fresh process.
"""

import json
import os
import signal
import subprocess

import binaries
import forked_python

# Seconds to wait for the server to say it forked.
_START_TIMEOUT = 60


# The test module's server (one test module per test process under Bazel).
_SHARED = []


def shared():
  """The test process's one `Server`, started on first use."""
  if not _SHARED:
    _SHARED.append(Server())
  return _SHARED[0]


def close_shared():
  """Closes `shared()`'s server, if started (a module's tearDownModule)."""
  while _SHARED:
    _SHARED.pop().close()

class Server(forked_python.Server):
  """A `forked_python.Server` whose children can run in the background.

  One child at a time: `start` reaps (killing it first) a child still
  running, and the blocking `run`/`run_module` wait for it.
  """
  # It speaks the base class's protocol (per request the child's pid, then
  # its exit code, one line each) through the base's protected members:
  # forked_python has no background start of its own.

  def __init__(self):
    super().__init__(binaries.env())
    self._running = None  # The `Process` started last, if not yet reaped.

  def start(self, args, log_path):
    """Starts `//:train` with flags `args`; returns its `Process`.

    Args:
      args: the flags.
      log_path: file receiving its stderr (where its log lines go); its
        stdout goes to `log_path + ".stdout"`.
    """
    return self._start({"module": "tf1_safe_train.train", "argv": list(args),
                        "env": binaries.env(), "cwd": os.getcwd()}, log_path)

  def start_code(self, code, args, log_path):
    """Starts `code` as `python -c code args...` would; returns its
    `Process` (output as for `start`)."""
    return self._start({"code": _with_argv(code, args), "cwd": os.getcwd()},
                       log_path)

  def run_train(self, args, timeout=600):
    """Runs `//:train` with flags `args` to its end, as `binaries.run`
    would; returns the `subprocess.CompletedProcess` (text)."""
    return self.run_module("tf1_safe_train.train", args, binaries.env(),
                           os.getcwd(), timeout)

  def run_code(self, code, args, timeout=600):
    """Runs `code` as `python -c code args...` would, to its end; returns
    the `subprocess.CompletedProcess` (text)."""
    return self.run(_with_argv(code, args), os.getcwd(), timeout)

  def _start(self, request, log_path):
    if self._running is not None:
      self._running.kill()
    self._lock.acquire()  # Released when the child is reaped.
    request.update(stdout=log_path + ".stdout", stderr=log_path)
    self._process.stdin.write(json.dumps(request).encode() + b"\n")
    self._process.stdin.flush()
    pid = self._child = int(self._read_line(_START_TIMEOUT))
    self._running = Process(self, pid)
    return self._running

  def _reaped(self, process):
    if self._running is process:
      self._running = None
      self._child = None
      self._lock.release()


def _with_argv(code, args):
  """`code` preceded by what gives it `sys.argv[1:] == args`."""
  return "import sys\nsys.argv[1:] = %s\n%s" % (json.dumps(list(args)), code)


class Process(object):
  """A child of `Server` as `subprocess.Popen` shows a process."""

  def __init__(self, server, pid):
    self._server = server
    self.pid = pid
    self.returncode = None

  def poll(self):
    """The exit code (negative: the signal) if it ended, else None."""
    if self.returncode is None:
      self._read_exit_code(0.001)
    return self.returncode

  def wait(self, timeout):
    """Waits for the end; `subprocess.TimeoutExpired` after `timeout` s."""
    if self.returncode is None and not self._read_exit_code(timeout):
      raise subprocess.TimeoutExpired("forked trainer %d" % self.pid,
                                      timeout)
    return self.returncode

  def kill(self):
    """SIGKILLs its process group and reaps it."""
    if self.returncode is None:
      try:
        os.killpg(self.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      self.wait(60)

  def _read_exit_code(self, timeout):
    line = self._server._read_line(timeout, or_none=True)  # pylint: disable=protected-access
    if line is None:
      return False
    self.returncode = int(line)
    self._server._reaped(self)  # pylint: disable=protected-access
    return True
