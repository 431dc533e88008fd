"""Cluster specs (TF_CONFIG), worker graphs' placement, CLI errors."""

import json
import os
import socket
import time

import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train.cluster import replicas
from tf1_safe_train.cluster import replication
from tf1_safe_train.cluster import spec as cluster_lib
from tf1_safe_train.core import rollback
from tf1_safe_train.trainer.drills import injection
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

_CLUSTER = {"ps": ["10.0.0.1:2222"],
            "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}


def _tf_config(cluster=None, task_type="worker", index=0):
  return json.dumps({"cluster": _CLUSTER if cluster is None else cluster,
                     "task": {"type": task_type, "index": index}})


class TfConfigTest(tf.test.TestCase):

  def testParsesWorkerAndChief(self):
    config = cluster_lib.from_tf_config(_tf_config(index=1))
    self.assertEqual(config.cluster, _CLUSTER)
    self.assertEqual((config.job_name, config.task_index), ("worker", 1))
    self.assertEqual((config.num_ps, config.num_workers), (1, 2))
    self.assertFalse(config.is_chief)
    self.assertEqual(config.address, "10.0.0.3:2222")
    self.assertTrue(cluster_lib.from_tf_config(_tf_config()).is_chief)
    self.assertFalse(cluster_lib.from_tf_config(_tf_config(
        task_type="ps")).is_chief)

  def testRoundTripAndOtherTask(self):
    config = cluster_lib.from_tf_config(_tf_config(index=1))
    self.assertEqual(cluster_lib.from_tf_config(config.to_tf_config()),
                     config)
    ps = config.for_task("ps", 0)
    self.assertEqual((ps.job_name, ps.task_index, ps.cluster),
                     ("ps", 0, _CLUSTER))

  def testEmptyMeansOneMachine(self):
    for value in (None, "", "  ", "{}"):
      self.assertIsNone(cluster_lib.from_tf_config(value), value)

  def testClusterSpecAndImmutability(self):
    config = cluster_lib.from_tf_config(_tf_config())
    self.assertEqual(config.cluster_spec().as_dict(), _CLUSTER)
    with self.assertRaises(Exception):
      config.task_index = 1  # pytype: disable=not-writable

  def testRejectsBadSpecsInOneLine(self):
    cases = [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"cluster": _CLUSTER}), "lacks 'task'"),
        (json.dumps({"task": {"type": "worker", "index": 0}}),
         "lacks 'cluster'"),
        (_tf_config(task_type="evaluator"), "'evaluator' is unknown"),
        (_tf_config(task_type="chief"), "list the chief as worker 0"),
        (_tf_config(dict(_CLUSTER, chief=["h:1"])), "job 'chief'"),
        (_tf_config(index=2), "out of range: there are 2 worker"),
        (_tf_config(index=-1), "out of range"),
        (_tf_config(index=True), "task index true must be an integer"),
        (_tf_config(index="0"), 'task index "0" must be an integer'),
        (_tf_config(index=1.0), "must be an integer"),
        (_tf_config({"ps": ["h:1"], "worker": []}), "no worker"),
        (_tf_config({"worker": ["h:1"]}), "no ps task"),
        (_tf_config({"ps": "h:1", "worker": ["h:2"]}), "must be a list"),
        (_tf_config({"ps": ["h"], "worker": ["h:2"]}), "ps 0 'h' is not "
         "host:port"),
        (_tf_config({"ps": ["h:0"], "worker": ["h:2"]}), "1..65535"),
        (_tf_config({"ps": ["h:99999"], "worker": ["h:2"]}), "1..65535"),
        (_tf_config({"ps": ["h:x"], "worker": ["h:2"]}), "1..65535"),
        (_tf_config({"ps": [":1"], "worker": ["h:2"]}), "not host:port"),
        (_tf_config({"ps": ["h:1"], "worker": ["h:2", "h:1"]}),
         "ps 0 and worker 1 have the same address h:1"),
        (json.dumps({"cluster": _CLUSTER, "task": "worker"}), "'task'"),
        # Regression tests (issue 32, 12): RecursionError; the last "task"
        # taken without a word.
        ("[" * 30000 + "]" * 30000, "nests arrays or objects 30000 levels"),
        (_tf_config()[:-1] + ', "task": {"type": "ps", "index": 0}}',
         'the key "task" twice'),
        ('{"cluster": {"ps": ["h:1"], "ps": ["h:3"], "worker": ["h:2"]}, '
         '"task": {"type": "ps", "index": 0}}', 'the key "ps" twice'),
    ]
    for value, expected in cases:
      with self.subTest(value=value):
        with self.assertRaises(cluster_lib.ClusterSpecError) as e:
          cluster_lib.from_tf_config(value)
        self.assertIn(expected, str(e.exception))
        self.assertNotIn("\n", str(e.exception))

  def testAcceptsHostNamesAndIpv6(self):
    config = cluster_lib.from_tf_config(_tf_config(
        {"ps": ["ps-0.example.com:2222"], "worker": ["[::1]:2223"]}))
    self.assertEqual(cluster_lib.split_address(config.worker[0]),
                     ("::1", 2223))


class WaitForPsTest(tf.test.TestCase):

  def testReturnsWhenPsListens(self):
    with socket.socket() as listener:
      listener.bind(("127.0.0.1", 0))
      listener.listen(1)
      config = cluster_lib.ClusterConfig(
          ps=["127.0.0.1:%d" % listener.getsockname()[1]],
          worker=["127.0.0.1:1"], job_name="worker", task_index=0)
      cluster_lib.wait_for_ps(config, timeout_secs=5)

  def testGivesUpAfterTheTimeout(self):
    config = cluster_lib.ClusterConfig(
        ps=["127.0.0.1:%d" % _closed_port()], worker=["127.0.0.1:1"],
        job_name="worker", task_index=0)
    start = time.monotonic()
    with self.assertRaisesRegex(cluster_lib.ClusterUnreachableError,
                                r"ps 0 at 127.0.0.1:\d+ is unreachable "
                                r"after 1s"):
      cluster_lib.wait_for_ps(config, timeout_secs=1, poll_secs=0.1)
    self.assertLess(time.monotonic() - start, 10)


def _closed_port():
  """A port nothing listens on (bound, then released)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class WorkerGraphTest(tf.test.TestCase):
  """The graph a worker builds: placement, and what the chief's apply runs."""

  def _build(self, num_ps=1, num_workers=2, task_index=1, **overrides):
    values = dict(model="resnet8", num_towers=2, device="cpu",
                  batch_size=2, train_dir=self.get_temp_dir())
    values.update(overrides)
    params = params_lib.TrainParams(**values).validate()
    config = cluster_lib.ClusterConfig(
        ps=["127.0.0.1:%d" % (2000 + i) for i in range(num_ps)],
        worker=["127.0.0.1:%d" % (3000 + i) for i in range(num_workers)],
        job_name="worker", task_index=task_index)
    strategy = replication.make(params, config)
    with strategy.device():
      return train_step.build_step(params, strategy), strategy

  def testStateLivesOnThePsAndTowersOnTheWorker(self):
    with tf.Graph().as_default() as graph:
      self._build()
      variables = tf1.global_variables()
      names = [v.op.name for v in variables]
      for expected in ("global_step", "applied_steps", "skipped_steps",
                       "consecutive_skips", "nonfinite_steps_by_tower",
                       "max_consecutive_skips_seen",
                       "resnet8/initial/conv/weights/Momentum"):
        self.assertIn(expected, names)
      # The statistics' flat shadow (one per device, named for the first).
      self.assertTrue(any(n.startswith(
          "resnet8/initial/bn/moving_mean/skip_shadow_of_") for n in names))
      for v in variables:
        self.assertStartsWith(v.device, "/job:ps/task:0", v.op.name)
      for tower in (0, 1):
        conv = graph.get_operation_by_name(
            "tower_%d/resnet8/initial/conv/Conv2D" % tower)
        self.assertEqual(conv.device,
                         "/job:worker/task:1/device:CPU:%d" % tower)
      # The towers read the iterator in a cond's branch (a replay reads
      # the batch store instead): its ops are in the branch functions.
      iterator = [node.device for function in
                  graph.as_graph_def().library.function
                  for node in function.node_def
                  if node.op == "IteratorGetNext"]
      self.assertLen(iterator, 2)
      for device in iterator:
        self.assertStartsWith(device, "/job:worker/task:1")

  def testVariablesSpreadOverSeveralPs(self):
    with tf.Graph().as_default():
      self._build(num_ps=2, model="small_cnn", num_towers=1)
      devices = set(v.device for v in tf1.global_variables())
    self.assertEqual(devices, {"/job:ps/task:0", "/job:ps/task:1"})

  def testChiefsApplyRunsNoForwardPassAndStatisticsTravelWithTheGradients(
      self):
    # One sync build (the chief's) proves both claims; one tower is enough
    # (no tower's ops may feed the apply, whatever their number).
    with tf.Graph().as_default():
      step, strategy = self._build(sync_replicas=True, task_index=0,
                                   num_towers=1)
      names = step.report.variable_names
      runner = strategy.sync_optimizer.get_chief_queue_runner()
      seen, stack = set(), [op for op in runner.enqueue_ops]
      while stack:
        op = stack.pop()
        if op in seen:
          continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    self.assertTrue(any(op.type == "ResourceApplyMomentum" or
                        "guarded_step" in op.name for op in seen))
    forward = [op.name for op in seen if op.name.startswith("tower_") or
               op.type == "IteratorGetNext"]
    self.assertEqual(forward, [])
    # The statistics travel with the gradients.
    self.assertIn("resnet8/initial/bn/moving_mean", names)
    self.assertIn("resnet8/initial/bn/moving_variance", names)
    self.assertIn("resnet8/initial/conv/weights", names)

  def testInjectionWorkerMustExist(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(injection.InjectionSpecError,
                                  "WORKER 2 out of range, there are 2"):
        self._build(model="small_cnn", inject_nonfinite="nan@1:0/2")

  def testStatisticsDeltasRejectAPlainAssign(self):
    with tf.Graph().as_default():
      v = tf1.get_variable("v", [2], initializer=tf1.zeros_initializer())
      deltas = rollback.statistics_deltas([
          v.assign_sub(tf.ones([2]), read_value=False),
          v.assign_add(tf.ones([2]) * 3, read_value=False)])
      self.assertLen(deltas, 1)
      self.assertIs(deltas[0][1], v)
      with self.cached_session() as sess:
        sess.run(v.initializer)
        self.assertAllClose(sess.run(deltas[0][0]), [-2.0, -2.0])
      with self.assertRaisesRegex(ValueError, "assign_add/assign_sub"):
        rollback.statistics_deltas([v.assign(tf.ones([2]),
                                              read_value=False)])


class ClusterCliTest(tf.test.TestCase, binaries.OneLineErrorAssertions):
  """The binary as users run it: cluster errors in one line."""

  def testBadClusterSpecs(self):
    train_dir = os.path.join(self.get_temp_dir(), "untouched")
    flags = ["--train_dir=" + train_dir]
    cases = [
        ({"tf_config": "{bad json"}, [], "TF_CONFIG is not valid JSON"),
        ({"tf_config": _tf_config(task_type="evaluator")}, [],
         "'evaluator' is unknown"),
        ({"tf_config": _tf_config(index=5)}, [],
         "task index 5 out of range"),
        ({"tf_config": _tf_config()}, ["--ps_hosts=h:1",
                                       "--worker_hosts=h:2",
                                       "--job_name=worker"], "given twice"),
        ({}, ["--ps_hosts=h:1", "--worker_hosts=h:2:x",
              "--job_name=worker"], "worker 0 'h:2:x'"),
        ({}, ["--ps_hosts=h:1", "--worker_hosts=h:2",
              "--job_name=worker", "--task_index=1"], "out of range"),
    ]
    for env, args, expected in cases:
      with self.subTest(args=args, env=env):
        start = time.monotonic()
        self.assertOneLineError(binaries.run("train", *(flags + args), **env),
                                expected, exit_code=2)
        # Checked before TensorFlow is imported, let alone a server started.
        self.assertLess(time.monotonic() - start, 60)
        self.assertFalse(os.path.exists(train_dir))

  # Regression test (issue 32, 12): a TF_CONFIG nested 30,000 levels deep
  # ended in a RecursionError traceback, exit 1; a key given twice was taken
  # last-wins without a word.
  def testAbsurdTfConfigIsRefusedBeforeTensorFlow(self):
    train_dir = os.path.join(self.get_temp_dir(), "untouched")
    cases = [
        ("[" * 30000 + "]" * 30000,
         "TF_CONFIG nests arrays or objects 30000 levels deep"),
        ('{"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": '
         '"ps", "index": 0}, "task": {"type": "worker", "index": 0}}',
         'TF_CONFIG has the key "task" twice in one object'),
    ]
    for tf_config, expected in cases:
      with self.subTest(expected=expected):
        self.assertOneLineError(
            binaries.run("train", "--train_dir=" + train_dir,
                         tf_config=tf_config, no_tensorflow=True),
            expected, exit_code=2)
        self.assertFalse(os.path.exists(train_dir))

  def testWorkerSelectorOutOfRange(self):
    result = binaries.run("train", "--train_dir=" + self.get_temp_dir(),
                          "--inject_nonfinite=nan@3:0/2",
                          tf_config=_tf_config(task_type="ps"))
    self.assertOneLineError(result, "WORKER 2 out of range, there are 2",
                            exit_code=2)

  def testSyncReplicasWithoutGlobalStepOnSkip(self):
    result = binaries.run("train", "--train_dir=" + self.get_temp_dir(),
                          "--sync_replicas",
                          "--noincrement_global_step_on_skip",
                          tf_config=_tf_config())
    self.assertOneLineError(result, "--sync_replicas needs", exit_code=2)

  def testUnreachablePsAfterBoundedWait(self):
    worker_port, ps_port = _closed_port(), _closed_port()
    start = time.monotonic()
    result = binaries.run("train", "--train_dir=" + self.get_temp_dir(),
                          "--ps_hosts=127.0.0.1:%d" % ps_port,
                          "--worker_hosts=127.0.0.1:%d" % worker_port,
                          "--job_name=worker", "--startup_timeout_secs=2",
                          timeout=120)
    self.assertOneLineError(
        result, "ps 0 at 127.0.0.1:%d is unreachable after 2s" % ps_port,
        exit_code=1)
    self.assertLess(time.monotonic() - start, 120)

  def testOwnPortInUse(self):
    with socket.socket() as busy, socket.socket() as ps:
      for s in (busy, ps):
        s.bind(("127.0.0.1", 0))
        s.listen(1)
      busy_port = busy.getsockname()[1]
      result = binaries.run("train", "--train_dir=" + self.get_temp_dir(),
                            "--ps_hosts=127.0.0.1:%d" % ps.getsockname()[1],
                            "--worker_hosts=127.0.0.1:%d" % busy_port,
                            "--job_name=worker", "--startup_timeout_secs=5",
                            timeout=120)
    self.assertOneLineError(
        result, "cannot start the gRPC server of worker 0 at 127.0.0.1:%d" %
        busy_port, exit_code=1)


if __name__ == "__main__":
  tf.test.main()
