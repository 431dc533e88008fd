"""The launcher's library: no flags of its own, and the arguments it refuses."""

import io
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import local_cluster_lib

_FLAGS_AFTER_IMPORT = """
from absl import flags
import tf1_safe_train.cluster.local_cluster_lib
print(sorted(flags.FLAGS.flags_by_module_dict()))
"""


class LocalClusterLibTest(tf.test.TestCase):

  def testImportDefinesNoFlag(self):
    result = subprocess.run(
        [sys.executable, "-c", _FLAGS_AFTER_IMPORT], capture_output=True,
        text=True, check=False, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), "[]")

  def testClusterFlagsAreRefused(self):
    local_cluster_lib.check_train_args(["--max_steps=3", "--sync_replicas"])
    for name in cluster_flags.NAMES:
      with self.subTest(flag=name):
        with self.assertRaisesRegex(ValueError, "--%s is set by local_cluster"
                                    % name):
          local_cluster_lib.check_train_args(["--%s=1" % name])

  def testClusterOnDistinctFreePorts(self):
    config = local_cluster_lib.make_cluster(num_ps=2, num_workers=2)
    addresses = config.ps + config.worker
    self.assertLen(set(addresses), 4)
    self.assertTrue(config.is_chief)


# A task that counts the SIGTERMs it gets (one line each in DIR/<task>) and
# never stops by itself: the launcher's grace period, then SIGKILL, end it.
_COUNTING_TASK = """
import json, os, signal, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
path = os.path.join(sys.argv[1], "%s%d" % (task["type"], task["index"]))
def count(signum, frame):
  with open(path, "a") as f:
    f.write("%d\\n" % signum)
signal.signal(signal.SIGTERM, count)
open(path + ".ready", "w").close()
while True:
  time.sleep(0.05)
"""


class StopOnceTest(tf.test.TestCase):

  # Regression test (issue 23, 9): a stop request reached each task twice
  # (once from the stop, once more from the final clean-up), which a
  # trainer takes as "stop at once, without the final checkpoint". Each
  # task now gets one SIGTERM, then after its grace period SIGKILL.
  def testEachTaskGetsOneSigterm(self):
    directory = self.get_temp_dir()
    launcher = local_cluster_lib.LocalCluster(
        1, 2, lambda unused_task: [sys.executable, "-c", _COUNTING_TASK,
                                   directory],
        out=io.StringIO(), err=io.StringIO(), stop_grace_secs=1.0)
    result = []
    thread = threading.Thread(target=lambda: result.append(launcher.run()))
    thread.start()
    names = ("ps0", "worker0", "worker1")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(directory, n + ".ready")) for n in names):
      time.sleep(0.05)
    launcher.request_stop(signal.SIGTERM)
    thread.join(timeout=240)
    self.assertFalse(thread.is_alive())
    self.assertEqual(result, [128 + signal.SIGTERM])
    for name in names:
      with open(os.path.join(directory, name)) as f:
        self.assertEqual(f.read().split(), [str(int(signal.SIGTERM))], name)


# A task that prints a line of its own and TensorFlow's rendezvous warning
# (as a worker does at shutdown, glog format), then ends.
_NOISY_TASK = """
import sys
print("my line")
sys.stderr.write("W0000 00:00:1796529948.308905    9566 local_rendezvous.cc:412] "
                 "Local rendezvous is aborting with status: ABORTED: Cleanup "
                 "73505207245471881 [type.googleapis.com/tensorflow."
                 "DerivedStatus='']\\n")
sys.stderr.write("W1206 a warning of the run\\n")
"""


class NoiseTest(tf.test.TestCase):

  # Regression test (issue 37, 9): a 2-machine //:local_cluster run printed
  # 17 "Local rendezvous is aborting with status: ABORTED: Cleanup ..."
  # warnings (TensorFlow's, at every cancelled receive) in its 73 lines.
  # They go to a log file; one line at the end names it.
  def testRendezvousWarningsGoToTheLogNotTheScreen(self):
    out, err = io.StringIO(), io.StringIO()
    log = os.path.join(self.get_temp_dir(), "noise.log")
    launcher = local_cluster_lib.LocalCluster(
        1, 1, lambda unused_task: [sys.executable, "-c", _NOISY_TASK],
        out=out, err=err, stop_grace_secs=5.0, noise_log=log)
    self.assertEqual(launcher.run(), 0)
    self.assertCountEqual(out.getvalue().splitlines(),
                          ["[ps 0] my line", "[worker 0] my line"])
    self.assertCountEqual(err.getvalue().splitlines(), [
        "[ps 0] W1206 a warning of the run",
        "[worker 0] W1206 a warning of the run",
        "local_cluster: 2 line(s) of TensorFlow's cleanup warnings (\"Local "
        "rendezvous is aborting with status: ABORTED: Cleanup ...\") not "
        "shown: " + log])
    with open(log) as f:
      kept = f.read().splitlines()
    self.assertLen(kept, 2)
    for line in kept:
      self.assertIn("Local rendezvous is aborting", line)


class FlagsTest(tf.test.TestCase):

  # Regression test (issue 23, 9): --stop_grace_secs=nan or -1 was
  # accepted ("still running nans after the chief finished").
  def testGracePeriodMustBeFiniteAndNotNegative(self):
    for value, text in (("nan", "must be a finite number"),
                        ("-inf", "must be a finite number"),
                        ("-1", "must be a finite number >= 0")):
      with self.subTest(value=value):
        result = binaries.run("local_cluster", "--stop_grace_secs=" + value,
                              "--", "--max_steps=1", timeout=120)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(binaries.our_lines(result.stderr), [
            "local_cluster: error: --stop_grace_secs=%s: %s" % (value, text)])

  # Regression test (issue 32, 12): --num_workers=100000 bound a socket per
  # task until `OSError: Too many open files`, a traceback and exit 1.
  def testMoreTasksThanTheMachineCanOpenAreRefusedBeforeOpeningAny(self):

    def open_files(limit):
      return lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                        (limit, limit))

    # With `ulimit -n 100`: (100 - 64 spare) / 2 files per task.
    for num_workers, limit, expected in (
        (100000, None, "100001 tasks are more than this launcher can start "
         "(at most "),
        (18, 100, "19 tasks are more than this launcher can start (at most "
         "18: each task holds 2 of the 100 open files `ulimit -n` allows)")):
      with self.subTest(num_workers=num_workers):
        result = subprocess.run(
            binaries.command("local_cluster") + [
                "--num_workers=%d" % num_workers, "--", "--max_steps=1"],
            capture_output=True, text=True, timeout=120, check=False,
            env=binaries.env(no_tensorflow=True),
            preexec_fn=limit and open_files(limit))
        self.assertEqual(result.returncode, 2, result.stderr)
        lines = binaries.our_lines(result.stderr)
        self.assertLen(lines, 1, result.stderr)
        self.assertStartsWith(lines[0], "local_cluster: error: --num_ps=1 "
                              "--num_workers=%d: %s" % (num_workers,
                                                        expected))


if __name__ == "__main__":
  tf.test.main()
