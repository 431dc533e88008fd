"""Clusters never hang and never roll each other back (loopback).

Regression tests of issue 17 (5): `kill -9` of //:local_cluster left the
workers alive and hung (their SIGTERM only set a flag while session.run
blocked on the dead ps); a restarted chief restored its old checkpoint onto
the live parameter servers. (The third, a worker whose ps was killed mid-run
stayed silent until the ps came back, is distributed_test's PsLostTest: its
ps and worker fork from that file's servers, no TensorFlow import of their
own.) The process test bounds its run with generous timeouts (a loaded
2-core machine) and kills whatever it started in a finally block.
"""

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import uuid

import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train.cluster import local_cluster_lib
from tf1_safe_train.cluster import replicas
from tf1_safe_train.trainer.config import params as params_lib

tf1 = tf.compat.v1

_TIMEOUT_SECS = 300
_TRAIN_FLAGS = ("--batch_size=4", "--num_towers=1", "--device=cpu",
                "--log_every_n_steps=5", "--save_summaries_steps=1000",
                "--save_checkpoints_steps=1000", "--max_steps=1000000")
_PROGRESS = re.compile(r"hooks.py:\d+\] step \d+/\d+ ")






def _read(path):
  with open(path, errors="replace") as f:
    return f.read()


def _wait_for(predicate, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.2)
  return bool(predicate())


class ClusterEndsTest(tf.test.TestCase):

  def _train_dir(self):
    return tempfile.mkdtemp(prefix="run_%s_" % uuid.uuid4().hex[:8],
                            dir=self.get_temp_dir())

  def testTasksAreOffTheNetworkAndDieWithAKilledLauncher(self):
    train_dir = self._train_dir()
    log_path = train_dir + ".log"
    with open(log_path, "w") as log:
      launcher = subprocess.Popen(
          binaries.command("local_cluster") + [
              "--num_ps=1", "--num_workers=2", "--",
              "--train_dir=" + train_dir] + list(_TRAIN_FLAGS),
          env=binaries.env(), stdout=log, stderr=subprocess.STDOUT,
          start_new_session=True)
    try:
      self.assertTrue(_wait_for(
          lambda: re.search(r"\[worker 1\].*" + _PROGRESS.pattern,
                            _read(log_path)) or launcher.poll() is not None,
          _TIMEOUT_SECS))
      self.assertIsNone(launcher.poll(), _read(log_path)[-3000:])
      text = _read(log_path)
      # Off the network: from here (outside its namespace) no task's gRPC
      # port answers, unless the launcher said it could not isolate them.
      ports = set(re.findall(r"127\.0\.0\.1:(\d+)", re.search(
          r"\] worker 0 of (\{[^}]*\})", text).group(1)))
      self.assertLen(ports, 3, text[-3000:])
      if "cannot give the cluster a private network namespace" not in text:
        for port in ports:
          with self.assertRaises(ConnectionRefusedError, msg=port):
            socket.create_connection(("127.0.0.1", int(port)), timeout=10)
      processes = {pid: binaries.has_tf_config(pid)
                   for pid in binaries.processes_with(train_dir)}
      tasks = [pid for pid, is_task in processes.items() if is_task]
      self.assertLen(tasks, 3, _read(log_path)[-3000:])
      # The launcher (and Bazel's stub that may run it): kill -9.
      binaries.kill([pid for pid, is_task in processes.items() if not is_task])
      launcher.wait(timeout=60)
      # Gone within the watchdog's polls (the ps dies at once of its
      # SIGTERM; a worker told to stop without its ps exits).
      gone = _wait_for(lambda: not set(tasks) & set(binaries.processes_with(
          train_dir)), 120)
      left = sorted(set(tasks) & set(binaries.processes_with(train_dir)))
    finally:
      if launcher.poll() is None:
        launcher.kill()
        launcher.wait(timeout=60)
      binaries.kill(binaries.processes_with(train_dir))
    self.assertTrue(gone, "tasks left running: %s" % left)
    # Issue 23, 9: the chief may get its parent-death SIGTERM more than
    # once (once per launcher thread it is handed to); those copies are one
    # request, never a "second signal" (stop_signals_test.py pins the rule).
    summary_path = os.path.join(train_dir, "run_summary.json")
    if os.path.exists(summary_path):
      with open(summary_path) as f:
        self.assertNotIn("second signal",
                         json.load(f).get("abort_reason", ""))


class RestartedChiefTest(tf.test.TestCase):
  """A chief's session creator against a live ps (servers in this process)."""

  def _chief_session(self, cluster, train_dir):
    """Builds the model on the ps and opens a chief session; returns it."""
    with tf1.device(tf1.train.replica_device_setter(
        worker_device=replicas.worker_device(cluster),
        cluster=cluster.cluster_spec())):
      step = tf1.train.get_or_create_global_step()
      tf1.Variable(1.0, name="weights")
      self._bump = step.assign(500)  # What the other workers' steps do.
    scaffold = tf1.train.Scaffold(saver=tf1.train.Saver())
    creator = replicas._ClusterSessionCreator(  # pylint: disable=protected-access
        scaffold, self._worker.target, None, True, train_dir,
        max_wait_secs=60, task_name=cluster.task_name)
    return creator.create_session(), step, scaffold.saver

  def testRestartedChiefKeepsTheLiveParameterServerState(self):
    train_dir = self.get_temp_dir()
    cluster = local_cluster_lib.make_cluster(num_ps=1, num_workers=1)
    params = params_lib.TrainParams(num_towers=1, device="cpu")
    self._ps = replicas.start_server(cluster.for_task("ps", 0), params)
    self._worker = replicas.start_server(cluster, params)
    with tf.Graph().as_default():
      session, step, saver = self._chief_session(cluster, train_dir)
      saver.save(session, train_dir + "/model.ckpt", global_step=step)
      session.run(self._bump)  # The other workers trained on.
      session.close()  # The chief dies.
    with tf.Graph().as_default():  # ... and is restarted.
      with self.assertLogs(level="WARNING") as logs:
        session, step, _ = self._chief_session(cluster, train_dir)
      self.assertEqual(session.run(step), 500)  # Not 0, the checkpoint's.
      session.close()
    self.assertIn("already hold the model at global_step 500", logs.output[0])
    self.assertIn("not from model.ckpt-0", logs.output[0])


if __name__ == "__main__":
  tf.test.main()
