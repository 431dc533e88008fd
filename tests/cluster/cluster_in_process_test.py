"""Clusters without three TensorFlow processes: statistics, the launcher.

1 ps (a thread) + 1 worker in this process keep the batch-norm statistics
unchanged on skipped steps; //:local_cluster's launcher runs stand-in tasks
(no TensorFlow). Split from distributed_test, whose 3-process clusters run
alone (exclusive): these need no such room. Every launcher test kills what
it started and checks that no process it started is left.
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import train_dirs
from tf1_safe_train.cluster import local_cluster_lib
from tf1_safe_train.cluster import replicas
from tf1_safe_train.cluster import replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

# Counters and statistics that change on a skipped step by design.
_COUNTERS = {"global_step", "applied_steps", "skipped_steps",
             "consecutive_skips", "max_consecutive_skips_seen",
             "nonfinite_steps_by_tower"}


def _changed(a, b):
  return sorted(name for name in a if not np.array_equal(a[name], b[name]))


class InProcessClusterTest(tf.test.TestCase):
  """1 ps (a thread) + 1 worker in this process: batch-norm statistics."""

  def _train(self, sync):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    params = params_lib.TrainParams(
        train_dir=train_dir, model="resnet8", num_towers=1, device="cpu",
        batch_size=4, max_steps=4, save_checkpoints_steps=1,
        save_summaries_steps=1000, log_every_n_steps=4, sync_replicas=sync,
        inject_into="input", inject_nonfinite="nan@1-2",
        max_consecutive_skips=0).validate()
    cluster = local_cluster_lib.make_cluster(num_ps=1, num_workers=1)
    ps = threading.Thread(target=replicas.serve_parameter_server,
                          args=(cluster.for_task("ps", 0), params),
                          daemon=True)
    ps.start()
    summary = train_lib.train(
        params, strategy=replication.make(params, cluster))
    ps.join(60)
    self.assertFalse(ps.is_alive(), "the ps did not end with the run")
    return train_dir, summary

  def _assertStatisticsUnchangedOnSkippedSteps(self, sync):
    train_dir, summary = self._train(sync)
    self.assertEqual((summary["global_step"], summary["skipped_steps"],
                      summary["applied_steps"]), (4, 2, 2))
    path = os.path.join(train_dir, "model.ckpt-%d")
    before, after, applied = (train_dirs.checkpoint_values(path % s) for s in (1, 3, 4))
    # NaN images poison the forward pass, so tower 0's moving statistics
    # would be NaN: they are applied with the decision, not before it.
    self.assertEqual(set(_changed(before, after)) - _COUNTERS, set())
    moved = _changed(after, applied)
    self.assertIn("resnet8/initial/bn/moving_mean", moved)
    self.assertTrue(any(n.startswith(
        "resnet8/initial/bn/moving_mean/skip_shadow_of_") for n in moved),
                    moved)
    self.assertEqual(train_dirs.nonfinite_entries(applied), [])

  def testAsyncBatchNormStatisticsUnchangedOnSkippedSteps(self):
    self._assertStatisticsUnchangedOnSkippedSteps(sync=False)

  def testSyncBatchNormStatisticsUnchangedOnSkippedAggregate(self):
    self._assertStatisticsUnchangedOnSkippedSteps(sync=True)


# A stand-in task for the launcher's tests: says hello on both streams, then
# does what its `<job><index>=<action>` argument says (default: wait). An
# exiting task first waits until every task has said hello (a file each in
# the `barrier=<dir>` argument's directory), not for a fixed time, which a
# loaded machine outlasted.
_FAKE_TASK = r"""
import json, os, sys, time
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
name = "%s%d" % (task["type"], task["index"])
print("hello from " + name, flush=True)
print("stderr of " + name, file=sys.stderr, flush=True)
actions = dict(a.split("=") for a in sys.argv[1:] if "=" in a)
barrier = actions.get("barrier")
if barrier:
  open(os.path.join(barrier, name), "w").close()
action = actions.get(name, "wait")
if action.startswith("exit"):
  tasks = sum(len(hosts) for hosts in config["cluster"].values())
  deadline = time.time() + 120
  while barrier and len(os.listdir(barrier)) < tasks and (
      time.time() < deadline):
    time.sleep(0.05)
  sys.exit(int(action[4:]))
time.sleep(300)
"""


class LocalClusterLauncherTest(tf.test.TestCase):
  """The launcher with stand-in tasks (no TensorFlow): fast."""

  def _launcher(self, marker, *actions, **kwargs):
    self._out, self._err = _Lines(), _Lines()
    barrier = tempfile.mkdtemp(dir=self.get_temp_dir())
    return local_cluster_lib.LocalCluster(
        1, 2, lambda unused_task: [sys.executable, "-c", _FAKE_TASK, marker,
                                   "barrier=" + barrier],
        list(actions), out=self._out, err=self._err, **kwargs)

  def _run(self, launcher, marker):
    try:
      return launcher.run()
    finally:
      left = binaries.kill_leftovers(marker)
      self.assertEqual(left, [], "processes left running")
      self.assertTrue(all(t.poll() is not None for t in launcher.tasks))

  def testExitsWithTheChiefsCodeAndStopsTheOthers(self):
    marker = "marker_" + uuid.uuid4().hex
    launcher = self._launcher(marker, "worker0=exit3")
    self.assertEqual(self._run(launcher, marker), 3)
    self.assertIn("[worker 0] hello from worker0", self._out.text)
    self.assertIn("[ps 0] hello from ps0", self._out.text)
    self.assertIn("[worker 1] stderr of worker1", self._err.text)

  def testCleanChiefWaitsThenStopsLeftovers(self):
    marker = "marker_" + uuid.uuid4().hex
    launcher = self._launcher(marker, "worker0=exit0", "worker1=exit0",
                              stop_grace_secs=1)
    self.assertEqual(self._run(launcher, marker), 0)
    self.assertIn("local_cluster: still running 1s after the chief "
                  "finished: ps 0; stopping them", self._err.text)

  def testTaskDyingBeforeTheChiefStopsTheCluster(self):
    marker = "marker_" + uuid.uuid4().hex
    launcher = self._launcher(marker, "worker1=exit5")
    self.assertEqual(self._run(launcher, marker), 1)
    self.assertIn("local_cluster: worker 1 exited with exit code 5 before "
                  "the chief finished; stopping the cluster", self._err.text)

  def testSignalStopsEveryTask(self):
    marker = "marker_" + uuid.uuid4().hex
    launcher = self._launcher(marker)
    result = []
    thread = threading.Thread(
        target=lambda: result.append(self._run(launcher, marker)))
    thread.start()
    deadline = time.monotonic() + 60
    while self._out.text.count("hello from") < 3:
      self.assertLess(time.monotonic(), deadline)
      time.sleep(0.1)
    launcher.request_stop(signal.SIGTERM)
    thread.join(60)
    self.assertFalse(thread.is_alive())
    self.assertEqual(result, [128 + signal.SIGTERM])

  def testTasksDieWithAKilledLauncher(self):
    marker = "marker_" + uuid.uuid4().hex
    script = ("import sys\n"
              "from tf1_safe_train.cluster import local_cluster_lib\n"
              "local_cluster_lib.LocalCluster(1, 2, lambda t: [sys.executable, "
              "'-c', %r, %r]).run()\n" % (_FAKE_TASK, marker))
    launcher = subprocess.Popen([sys.executable, "-c", script],
                                env=binaries.env(), stdout=subprocess.PIPE,
                                text=True)
    try:
      for _ in range(3):
        self.assertIn("hello from", launcher.stdout.readline())
      launcher.kill()
      launcher.wait(timeout=30)
      deadline = time.monotonic() + 30
      while binaries.processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    finally:
      if launcher.poll() is None:
        launcher.kill()
      launcher.stdout.close()
      left = binaries.kill_leftovers(marker)
    self.assertEqual(left, [])

  def testRejectsClusterFlagsInOneLine(self):
    # The launcher imports no TensorFlow: a fresh process that cannot
    # (no forked_python server to start for this one run).
    result = binaries.run("local_cluster", "--", "--job_name=ps", timeout=120,
                          no_tensorflow=True)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(result.stderr.strip().splitlines()[-1],
                     "local_cluster: error: --job_name is set by "
                     "local_cluster (through TF_CONFIG); do not pass it")


class _Lines(object):
  """A thread-safe text sink with `write` and `flush`."""

  def __init__(self):
    self._parts = []
    self._lock = threading.Lock()

  def write(self, text):
    with self._lock:
      self._parts.append(text)

  def flush(self):
    pass

  @property
  def text(self):
    with self._lock:
      return "".join(self._parts)


if __name__ == "__main__":
  tf.test.main()
