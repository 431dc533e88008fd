"""A forked run is a fresh process's twin: same exit code, output, env, cwd.

Each case runs a tiny main module both ways, `python -m` in a new process and
`forked_python.Server.run_module`, and compares what a test reads; a hung
child is killed at its timeout without the server. `binaries.run` forks a
binary the same way, unless asked for a fresh process or its environment
needs one. Both classes use the one server `binaries.run` forks from.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import tensorflow as tf

import binaries
import forked_python

# A main module that ends in the way its first argument names.
_MODULE = r'''
import atexit, os, signal, subprocess, sys, time
from absl import app, flags
flags.DEFINE_string("greeting", "hello", "What to print.")


def main(argv):
  how = argv[1]
  print(flags.FLAGS.greeting, os.environ.get("FORKED_TEST_VARIABLE"),
        os.getcwd(), sys.argv[0].endswith("ending.py"))
  sys.stderr.write("to stderr\n")
  if how == "exit":
    sys.exit(3)
  if how == "os_exit":  # As cli.fail_now: flushed by hand, then _exit.
    sys.stdout.write("last words")
    sys.stdout.flush()
    os._exit(4)
  if how == "raise":
    raise ValueError("boom")
  if how == "signal":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
  if how == "atexit":
    atexit.register(print, "at exit")
  if how == "hang":  # With a child of its own, its pid in argv[2].
    sleeper = subprocess.Popen(["sleep", "600"])
    with open(argv[2], "w") as f:
      f.write("%d %d" % (os.getpid(), sleeper.pid))
    time.sleep(600)
  if how == "tf_flag":  # Known once parsed, as after a late TF import.
    print("test_random_seed", flags.FLAGS.test_random_seed)


app.run(main)
'''


def _alive(pid):
  try:
    with open("/proc/%d/stat" % pid) as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


# Module `ending` on this process's path before `binaries` starts its server
# (its children's path is this one): one server, one TensorFlow import, for
# both classes.
_MODULES = tempfile.mkdtemp()
with open(os.path.join(_MODULES, "ending.py"), "w") as _f:
  _f.write(_MODULE)
sys.path.insert(0, _MODULES)


def tearDownModule():
  shutil.rmtree(_MODULES, ignore_errors=True)


class ForkedPythonTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super(ForkedPythonTest, cls).setUpClass()
    cls.env = binaries.env()  # This process's, `ending` on PYTHONPATH.
    # pylint: disable-next=protected-access
    cls.server = binaries._server()  # A `forked_python.Server`.
    assert isinstance(cls.server, forked_python.Server)

  def _both(self, *argv):
    """(fresh, forked) `CompletedProcess` of module `ending` with `argv`."""
    env = dict(self.env, FORKED_TEST_VARIABLE="set")
    cwd = self.get_temp_dir()
    fresh = subprocess.run([sys.executable, "-m", "ending"] + list(argv),
                           env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=60, check=False)
    forked = self.server.run_module("ending", argv, env, cwd, timeout=60)
    return fresh, forked

  def testSameExitCodeAndOutputsHoweverItEnds(self):
    for how in ("return", "exit", "os_exit", "signal", "atexit"):
      with self.subTest(how=how):
        fresh, forked = self._both("--greeting=hi", how)
        self.assertIn("hi set %s True" % self.get_temp_dir(), fresh.stdout)
        self.assertEqual(forked.returncode, fresh.returncode)
        self.assertEqual(forked.stdout, fresh.stdout)
        self.assertEqual(forked.stderr, fresh.stderr)
    self.assertEqual(fresh.stdout.splitlines()[-1], "at exit")

  def testUncaughtExceptionGivesTracebackAndExitOne(self):
    fresh, forked = self._both("raise")
    for result in (fresh, forked):
      self.assertEqual(result.returncode, 1)
      self.assertIn("Traceback", result.stderr)
      self.assertEqual(result.stderr.splitlines()[-1], "ValueError: boom")
    self.assertEqual(forked.stdout, fresh.stdout)

  def testTensorFlowFlagsUnknownWhileParsingKnownAfter(self):
    fresh, forked = self._both("--test_random_seed=1", "return")
    self.assertEqual(forked.returncode, fresh.returncode)
    self.assertNotEqual(forked.returncode, 0)
    self.assertIn("test_random_seed", forked.stderr)
    forked = self.server.run_module("ending", ["tf_flag"], self.env,
                                    self.get_temp_dir(), timeout=60)
    self.assertEqual(forked.returncode, 0, forked.stderr)
    self.assertIn("test_random_seed 301", forked.stdout)

  def testTimeoutKillsTheChildAndWhatItStartedNotTheServer(self):
    # A short timeout, four times longer while the child was killed before
    # it wrote both pids (a loaded machine): the checks do not depend on it.
    written = []
    for timeout in (2, 8, 32, 128):
      pids = os.path.join(self.get_temp_dir(), "pids%d" % timeout)
      with self.assertRaises(subprocess.TimeoutExpired):
        self.server.run_module("ending", ["hang", pids], self.env,
                               self.get_temp_dir(), timeout=timeout)
      if os.path.exists(pids):
        with open(pids) as f:
          written = [int(pid) for pid in f.read().split()]
        if len(written) == 2:
          break
    self.assertLen(written, 2)
    for pid in written:
      self.assertFalse(_alive(pid), pid)
    _, forked = self._both("exit")
    self.assertEqual(forked.returncode, 3)


class BinariesRunTest(tf.test.TestCase):

  def testForkedRunOfABinaryEqualsAFreshOne(self):
    args = ("--no_such_flag=1",)
    fresh = binaries.run("train", *args, fresh_process=True)
    forked = binaries.run("train", *args)
    self.assertEqual(forked.args[:2], ["forked_python", "-m"])
    self.assertEqual(forked.returncode, 2)
    self.assertEqual(forked.returncode, fresh.returncode)
    self.assertEqual(binaries.our_lines(forked.stderr),
                     binaries.our_lines(fresh.stderr))
    self.assertEqual(forked.stdout, fresh.stdout)

  def testRunsFreshWhenTheEnvironmentIsReadAtImport(self):
    for env_args in ({"no_tensorflow": True}, {"TF_ENABLE_ONEDNN_OPTS": "0"}):
      with self.subTest(env_args=env_args):
        result = binaries.run("train", "--no_such_flag=1", **env_args)
        self.assertEqual(result.args, binaries.command("train") +
                         ["--no_such_flag=1"])
        self.assertEqual(result.returncode, 2, result.stderr)


if __name__ == "__main__":
  tf.test.main()
