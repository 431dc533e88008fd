"""The project's binaries as tests run them: found, started, their errors read.

Under `bazel test` a binary is the Bazel-built one in the test's runfiles (the
test lists it in its `data`); elsewhere it is `python -m tf1_safe_train.NAME`.
Its stderr is read without TensorFlow's C++ start-up notices.

`run` runs a binary to its end in a child forked from a server that imported
TensorFlow once (`forked_python`; one server per test process, started on
first use, ended at exit), not in a new process: about 4 CPU s less a launch.
The child applies the run's environment and working directory, then runs the
binary's main module as `python -m` would (fresh `__main__`, same argv; the
server imported only TensorFlow, numpy and absl, none of this project's
modules), and ends as a process does (sys.exit, cli's os._exit, a signal, an
uncaught exception): the run gives the same exit code and the same stdout and
stderr text (TensorFlow's start-up notices and a traceback's frames aside).
So a forked run proves what the binary's code does: flags, exit codes, error
lines, files written.
It does not prove what start-up does: the Bazel launcher or `python -m`
finding the module, TensorFlow's import and its start-up lines (the server
prints them, once), what a variable read at TensorFlow's import changes
(TF_CPP_MIN_LOG_LEVEL...: a run whose environment differs from the server's
in anything but TF_CONFIG, TF1_SAFE_TRAIN_*, BUILD_WORKING_DIRECTORY starts a
fresh process, as `no_tensorflow` does). Nor does it give the binary a pid
whose /proc command line is its own, a stdin (it reads /dev/null), Python's
hash seed or TensorFlow's process-wide state (set at import) of its own.
Tests about those pass `fresh_process=True` (or use `command`);
BINARIES_FRESH_PROCESS=1 in the environment makes every run fresh.
"""

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import forked_python

# TensorFlow's C++ start-up notices (glog format, printed before its logging
# is configured) are not ours to count.
_TF_NOTICE = re.compile(r"^([IWE]\d{4} |WARNING: All log messages before absl)")


def command(name):
  """The command line that starts binary `name` of tf1_safe_train.

  Args:
    name: the binary, e.g. "train", "eval" or "local_cluster".

  Returns:
    The Bazel-built binary when run by `bazel test`, else the module, as a
    list of arguments.
  """
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    path = os.path.join(srcdir, os.environ["TEST_WORKSPACE"],
                        "tf1_safe_train", name)
    if os.path.exists(path):
      return [path]
  return [sys.executable, "-m", "tf1_safe_train." + name]


_NO_TENSORFLOW = 'raise ImportError("tensorflow was imported")\n'


def _no_tensorflow_dir():
  """A directory whose `tensorflow` package fails to import (made once)."""
  path = os.path.join(tempfile.gettempdir(), "binaries_no_tensorflow_%d" %
                      os.getpid())
  package = os.path.join(path, "tensorflow")
  if not os.path.exists(package):
    os.makedirs(package)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
      f.write(_NO_TENSORFLOW)
  return path


def env(tf_config=None, no_tensorflow=False, **extra):
  """The environment of a binary: this one, quiet, on this `sys.path`.

  An inherited TF_CONFIG is dropped, so a binary runs on one machine unless
  the test says otherwise.

  Args:
    tf_config: the TF_CONFIG JSON to set, or None for none.
    no_tensorflow: whether importing TensorFlow fails (with a traceback):
      for what a binary must do before it imports TensorFlow.
    **extra: further variables to set.

  Returns:
    The environment, a new dict.
  """
  path = ([_no_tensorflow_dir()] if no_tensorflow else []) + sys.path
  result = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONPATH=os.pathsep.join(path), **extra)
  result.pop("TF_CONFIG", None)
  if tf_config is not None:
    result["TF_CONFIG"] = tf_config
  return result


def run(name, *args, timeout=300, fresh_process=False, **env_args):
  """Runs binary `name` with flags `args` to its end.

  Args:
    name: the binary, as for `command`.
    *args: its arguments.
    timeout: seconds before `subprocess.TimeoutExpired` is raised (the
      binary killed).
    fresh_process: whether to start the binary itself (`command`) rather
      than fork it from the server (see the module docstring); it is
      started anyway when the environment asks for what a fork cannot give
      (no_tensorflow, a variable TensorFlow reads when imported).
    **env_args: passed to `env` (tf_config, no_tensorflow, extra
      variables).

  Returns:
    The `subprocess.CompletedProcess`, stdout and stderr as text.
  """
  environ = env(**env_args)
  if not fresh_process and _forkable(environ):
    return _server().run_module("tf1_safe_train." + name, args, environ,
                                os.getcwd(), timeout)
  return subprocess.run(command(name) + list(args), capture_output=True,
                        text=True, env=environ, timeout=timeout, check=False)


def run_code(code, *args, timeout=300):
  """Runs `code` (e.g. a driver that patches the trainer, then runs
  `//:train`'s main) as `python -c code args...` would, forked from the
  server `run` uses; returns the `subprocess.CompletedProcess` (text)."""
  return _server().run("import sys\nsys.argv[1:] = %r\n%s" % (list(args),
                                                              code),
                       os.getcwd(), timeout)


# Variables read when a binary runs, not when TensorFlow is imported: a
# forked run may differ from the server in them (PYTEST_CURRENT_TEST is
# pytest's, for no binary).
_RUN_TIME_VARIABLES = ("TF_CONFIG", "TF1_SAFE_TRAIN_",
                       "BUILD_WORKING_DIRECTORY", "PYTEST_CURRENT_TEST")

_SERVER = []  # The one forked_python server of this process, once started.


def _server():
  """This process's server (started on first use, ended at exit)."""
  if not _SERVER:
    _SERVER.append((forked_python.Server(env()), env()))
    atexit.register(_close_server)
  return _SERVER[0][0]


def _close_server():
  while _SERVER:
    _SERVER.pop()[0].close()


def _forkable(environ):
  """Whether a forked run sees environment `environ` as a fresh one would:
  it differs from the server's only in variables read at run time."""
  if os.environ.get("BINARIES_FRESH_PROCESS") == "1":
    return False
  server_env = _SERVER[0][1] if _SERVER else env()
  for name in set(environ) | set(server_env):
    if (environ.get(name) != server_env.get(name) and
        not name.startswith(_RUN_TIME_VARIABLES)):
      return False
  return True


def our_lines(text):
  """The output lines that are not TensorFlow's C++ start-up notices."""
  return [line for line in text.splitlines() if not _TF_NOTICE.match(line)]


def error_lines(text):
  """Our output lines that mention an error."""
  return [line for line in our_lines(text) if "error" in line.lower()]


class OneLineErrorAssertions(object):
  """`assertOneLineError` for a `tf.test.TestCase` running `train`."""

  def assertOneLineError(self, result, *expected, exit_code=None):
    """Checks that `result` failed with one "train: error: " line, last.

    Args:
      result: a `subprocess.CompletedProcess` of `run`.
      *expected: texts the error line must contain.
      exit_code: the exit code it must have, or None for any but 0.
    """
    self.assertNotEqual(result.returncode, 0, result.stderr)
    if exit_code is not None:
      self.assertEqual(result.returncode, exit_code, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    errors = error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertTrue(errors[0].startswith("train: error: "), errors[0])
    self.assertEqual(our_lines(result.stderr.strip())[-1], errors[0])
    for text in expected:
      self.assertIn(text, errors[0])


def processes_with(marker):
  """Pids (other than ours) whose command line holds `marker` (e.g. a run's
  unique train_dir): what a test checks is left running, or kills."""
  found = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      with open("/proc/%s/cmdline" % pid, "rb") as f:
        if marker.encode() in f.read():
          found.append(int(pid))
    except OSError:
      continue
  return found


def has_tf_config(pid):
  """True if process `pid` runs with a TF_CONFIG (a cluster task), False
  otherwise or if it is gone."""
  try:
    with open("/proc/%d/environ" % pid, "rb") as f:
      return b"TF_CONFIG=" in f.read()
  except OSError:
    return False


def kill(pids):
  """SIGKILLs `pids`, those already gone included."""
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def kill_leftovers(marker):
  """Kills (and returns) the processes whose command line holds `marker`."""
  left = processes_with(marker)
  kill(left)
  return left


def run_to_end(command, marker, timeout):
  """Runs `command` (a launcher of several processes) to its end.

  Returns (exit code, stdout, stderr, the pids still running with `marker`
  in their command line afterwards, which it kills): a test asserts there
  are none. A run over `timeout` seconds is killed first.
  """
  process = subprocess.Popen(command, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  try:
    out, err = process.communicate(timeout=timeout)
  finally:
    if process.poll() is None:
      process.kill()
      process.communicate()
    left = kill_leftovers(marker)
  return process.returncode, out, err, left
