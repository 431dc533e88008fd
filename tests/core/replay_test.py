"""The replay probe: the first non-finite op, its phase, the bad input rows."""

import numpy as np
import tensorflow as tf

from bench import executed_ops
from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import replay
from tf1_safe_train.core import skip_log
from tf1_safe_train.core import wrapper_replay

tf1 = tf.compat.v1

NAN = float("nan")
GOOD = np.array([[1.0, 2.0], [0.5, -1.0], [2.0, 1.5], [-0.5, 0.25]],
                np.float32)


def _nan_rows(rows):
  batch = GOOD.copy()
  batch[rows, 1] = NAN
  return batch


def _dense_model(x):
  """x [4, 2] -> layer/MatMul -> loss; returns (loss, gradients, w)."""
  w = tf1.get_variable("w", initializer=tf.constant([[0.5], [-0.25]]))
  with tf1.name_scope("layer"):
    h = tf.matmul(x, w)
  loss = tf.reduce_mean(tf.square(h - 1.0), name="loss")
  return loss, tf.gradients(loss, [w]), w


class ProbeTest(tf.test.TestCase):

  def _run(self, build, feed_value, init=None):
    """Probes the outputs `build(x)` returns; replays `feed_value` as x."""
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 2], name="x")
      outputs = build(x)
      probe = replay.Probe([x], outputs)
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        if init is not None:
          init(sess)
        return probe, probe.run(sess, {x: feed_value})

  def testNanInputNamesRowsAndFirstConsumer(self):
    _, finding = self._run(lambda x: [_dense_model(x)[0]], _nan_rows([1, 3]))
    self.assertFalse(finding.finite)
    self.assertEqual({"x:0": [1, 3]}, finding.nonfinite_inputs)
    self.assertEqual("layer/MatMul", finding.first_op)
    self.assertEqual("forward", finding.phase)
    self.assertEqual(["loss:0"], finding.nonfinite_outputs)
    self.assertEqual(
        "input holds NaN/Inf: rows [1, 3] (examples [4711, 4713]); "
        "first non-finite: layer/MatMul (forward)",
        replay.describe(finding, example_ids=[4710, 4711, 4712, 4713]))

  def testLogOfZeroIsForward(self):
    def build(x):
      with tf1.name_scope("model"):
        y = tf.math.log(tf.abs(x), name="log")
      return [tf.reduce_sum(y)]
    batch = GOOD.copy()
    batch[2, 0] = 0.0
    _, finding = self._run(build, batch)
    self.assertEqual({}, finding.nonfinite_inputs)
    self.assertEqual("model/log", finding.first_op)
    self.assertEqual("forward", finding.phase)
    self.assertEqual("input finite; first non-finite: model/log (forward)",
                     replay.describe(finding))

  def testSqrtAtZeroIsBackward(self):
    # sqrt(0) = 0 is finite; its gradient 0.5 / sqrt(0) is Inf.
    def build(x):
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 1.0]))
      with tf1.name_scope("tower_1"):
        loss = tf.reduce_sum(tf.sqrt(tf.abs(x) * w))
        tf.gradients(loss, [w])  # A first call: the next is "gradients_1".
        grads = tf.gradients(loss, [w])
      return [loss] + grads
    batch = GOOD.copy()
    batch[0, 1] = 0.0
    probe, finding = self._run(build, batch)
    self.assertEqual({}, finding.nonfinite_inputs)
    self.assertTrue(finding.first_op.startswith("tower_1/gradients_1/"),
                    finding.first_op)
    self.assertEqual("backward", finding.phase)
    # The loss is finite, only the gradient is not.
    self.assertEqual([probe.outputs[1].name], finding.nonfinite_outputs)

  def testPhaseOfNames(self):
    self.assertEqual("backward", replay.phase_of("gradients/a/Mul_grad/Mul"))
    self.assertEqual("backward",
                     replay.phase_of("tower_1/gradients_1/conv/Conv2D_grad/X"))
    self.assertEqual("forward", replay.phase_of("gradients_norm/Sqrt"))
    self.assertEqual("forward", replay.phase_of("model/gradients"))

  def testNonFiniteResourceWeightIsItsRead(self):
    with test_util.tf_config(resource_variables=True):
      def poison(sess):
        w = tf1.global_variables()[0]
        sess.run(w.assign([[NAN], [1.0]]))
      _, finding = self._run(lambda x: [_dense_model(x)[0]], GOOD,
                             init=poison)
    self.assertEqual({}, finding.nonfinite_inputs)
    self.assertTrue(finding.first_op.endswith("ReadVariableOp"),
                    finding.first_op)

  def testNonFiniteRefWeightIsTheVariable(self):
    with test_util.tf_config(resource_variables=False):
      def poison(sess):
        sess.run(tf1.global_variables()[0].assign([[NAN], [1.0]]))
      _, finding = self._run(lambda x: [_dense_model(x)[0]], GOOD,
                             init=poison)
    self.assertEqual("w", finding.first_op)

  def testFiniteReplay(self):
    def build(x):
      loss, grads, _ = _dense_model(x)
      return [loss] + grads
    probe, finding = self._run(build, GOOD)
    self.assertTrue(finding.finite)
    self.assertIsNone(finding.first_op)
    self.assertIsNone(finding.phase)
    self.assertEqual(probe.ops_checked, finding.ops_checked)
    self.assertGreater(finding.ops_checked, 5)
    self.assertEqual(0, finding.ops_not_checked)
    self.assertEqual("finite on replay", replay.describe(finding))

  def testEveryFloatOutputOfAnOpIsChecked(self):
    # Split's first output is finite, its second holds the NaN.
    def build(x):
      a, b = tf.split(x, 2, axis=1, name="split")
      return [tf.reduce_sum(a), tf.reduce_sum(b)]
    _, finding = self._run(build, _nan_rows([0]))
    self.assertEqual("split", finding.first_op)

  def testHalfBfloatAndDoubleOps(self):
    for dtype in (tf.float16, tf.bfloat16, tf.float64):
      def build(x, dtype=dtype):
        with tf1.name_scope("m"):
          y = tf.math.log(tf.cast(tf.abs(x), dtype), name="log")
        return [tf.reduce_sum(tf.cast(y, tf.float32))]
      batch = GOOD.copy()
      batch[3, 1] = 0.0
      _, finding = self._run(build, batch)
      self.assertEqual("m/log", finding.first_op, dtype)

  def testFusedBatchNormGradients(self):
    # FusedBatchNormGradV3's unread reserve_space outputs come out with
    # another rank than declared: checking them failed the replay.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [2, 2, 2, 3], name="x")
      scale = tf1.get_variable("scale", initializer=tf.ones([3]))
      offset = tf1.get_variable("offset", initializer=tf.zeros([3]))
      y, _, _ = tf1.nn.fused_batch_norm(x, scale, offset, is_training=True)
      loss = tf.reduce_sum(tf.square(y))
      probe = replay.Probe([x], [loss] + tf.gradients(loss, [scale, offset]))
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        batch = np.arange(24, dtype=np.float32).reshape(2, 2, 2, 3)
        self.assertTrue(probe.run(sess, {x: batch}).finite)

  def testIndexedSlicesGradientsAreProbedByValues(self):
    with tf.Graph().as_default():
      ids = tf1.placeholder(tf.int32, [2], name="ids")
      table = tf1.get_variable("table", initializer=tf.constant(
          [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
      loss = tf.reduce_sum(tf.square(tf.gather(table, ids)))
      grad, = tf.gradients(loss, [table])
      self.assertIsInstance(grad, tf.IndexedSlices)
      probe = replay.Probe([ids], [loss, grad, None])
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        self.assertTrue(probe.run(sess, {ids: [0, 2]}).finite)
        sess.run(table.assign([[1.0, 2.0], [3.0, 4.0], [NAN, 6.0]]))
        finding = probe.run(sess, {ids: [0, 2]})
    self.assertEqual({}, finding.nonfinite_inputs)  # ids are not floats.
    self.assertIn(grad.values.name, finding.nonfinite_outputs)

  def testCondV1AndV2(self):
    for control_flow_v2 in (False, True):
      with test_util.tf_config(control_flow_v2=control_flow_v2):
        def build(x):
          h = tf.reduce_sum(x, axis=1, name="h")
          y = tf.cond(tf.reduce_all(h > -100.0),
                      lambda: tf.math.log(h * h), lambda: h, name="branch")
          return [tf.reduce_sum(y, name="out")]
        probe, finding = self._run(build, _nan_rows([2]))
        self.assertEqual("h", finding.first_op)
        self.assertGreater(probe.ops_not_checked, 0)
        batch = GOOD.copy()
        batch[1] = [1.0, -1.0]  # h = 0: log(0) inside the taken branch.
        probe, finding = self._run(build, batch)
        self.assertEqual({}, finding.nonfinite_inputs)
        # Inside the branch nothing is fetchable: its result is named.
        self.assertTrue(finding.first_op.startswith("branch"),
                        finding.first_op)

  def testV1WhileLoopIsNotChecked(self):
    with test_util.tf_config(control_flow_v2=False):
      def build(x):
        _, y = tf1.while_loop(lambda i, y: i < 3,
                              lambda i, y: (i + 1, y * 2.0), [0, x])
        return [tf.reduce_sum(tf.math.log(tf.abs(y)), name="out")]
      batch = GOOD.copy()
      batch[0, 0] = 0.0
      probe, finding = self._run(build, batch)
    self.assertGreater(probe.ops_not_checked, 0)
    self.assertEqual({}, finding.nonfinite_inputs)
    self.assertEqual("Log", finding.first_op)

  def testFedInputsCutTheIterator(self):
    with tf.Graph().as_default():
      dataset = tf.data.Dataset.from_tensor_slices(
          (np.arange(8, dtype=np.float32).reshape(4, 2), np.arange(4)))
      images, labels = tf1.data.make_one_shot_iterator(dataset).get_next()
      loss = tf.reduce_sum(images * tf.cast(labels, tf.float32))
      with self.assertLogs(level="WARNING") as logs:
        replay.Probe([images], [loss], name="images_only")
      self.assertIn("consumes a batch", "".join(logs.output))
      probe = replay.Probe([images, labels], [loss])
      with self.session() as sess:
        finding = probe.run(sess, {images: [NAN, 1.0], labels: 1})
        # Fed images and labels: the iterator did not move.
        self.assertEqual(0, sess.run(labels))
    self.assertEqual({images.name: [0]}, finding.nonfinite_inputs)

  def testUnfedPlaceholderIsOneClearError(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 2], name="x")
      scale = tf1.placeholder(tf.float32, [], name="scale")
      probe = replay.Probe([x], [tf.reduce_sum(x * scale)])
      with self.session() as sess:
        with self.assertRaisesRegex(ValueError, "no value for placeholder "
                                    "scale:0"):
          probe.run(sess, {x: GOOD})
        self.assertTrue(probe.run(sess, {"x:0": GOOD, scale: 2.0}).finite)

  def testTrainingStepNeverRunsTheProbe(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 2], name="x")
      loss, grads, w = _dense_model(x)
      train_op = tf1.train.GradientDescentOptimizer(0.1).apply_gradients(
          [(grads[0], w)])
      probe = replay.Probe([x], [loss] + grads, name="nonfinite_probe")
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        metadata = executed_ops.trace_run(sess, train_op, {x: GOOD})
        names = executed_ops.executed_node_names(metadata)
        self.assertIn("layer/MatMul", names)
        self.assertFalse([n for n in names if "nonfinite_probe" in n])
        metadata = tf1.RunMetadata()
        sess.run(probe._flags, {x: GOOD},  # pylint: disable=protected-access
                 options=tf1.RunOptions(
                     trace_level=tf1.RunOptions.FULL_TRACE),
                 run_metadata=metadata)
        self.assertTrue([n for n in executed_ops.executed_node_names(metadata)
                         if n.startswith("nonfinite_probe/")])

  def testWorksInAMonitoredSessionHook(self):

    class ReplayHook(tf1.train.SessionRunHook):

      def __init__(self, probe):
        self.probe = probe
        self.findings = []

      def after_run(self, run_context, run_values):
        self.findings.append(self.probe.run(
            run_context.session, run_context.original_args.feed_dict))

    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 2], name="x")
      loss, grads, _ = _dense_model(x)
      hook = ReplayHook(replay.Probe([x], [loss] + grads))
      with tf1.train.MonitoredSession(hooks=[hook]) as sess:
        sess.run(loss, {x: GOOD})
        sess.run(loss, {x: _nan_rows([2])})
    self.assertTrue(hook.findings[0].finite)
    self.assertEqual({"x:0": [2]}, hook.findings[1].nonfinite_inputs)
    self.assertEqual("layer/MatMul", hook.findings[1].first_op)

  def testWarnsWhenTheReplayWouldWriteVariables(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 2], name="x")
      count = tf1.get_variable("count", initializer=0.0)
      with tf.control_dependencies([count.assign_add(1.0)]):
        loss = tf.reduce_sum(x)
      with self.assertLogs(level="WARNING") as logs:
        probe = replay.Probe([x], [loss])
    self.assertEqual(1, len(probe.writes))
    self.assertIn("write variables", "".join(logs.output))

  def testDescribeSeveralInputsAndOutputsOnly(self):
    finding = replay.Finding(
        finite=False, nonfinite_inputs={"a:0": [0], "b:0": list(range(12))},
        first_op=None, phase=None, nonfinite_outputs=["loss:0"],
        ops_checked=3, ops_not_checked=2, seconds=0.0)
    self.assertEqual(
        "input holds NaN/Inf: a:0 rows [0], b:0 rows [0, 1, 2, 3, 4, 5, 6, "
        "7, 8, 9, ... (+2 more)"
        "]; first non-finite: not among the 3 probed ops (2 not checked); "
        "outputs: loss:0", replay.describe(finding))
    self.assertEqual(replay.describe(finding), str(finding))


def _wrapped_step():
  """x [4, 2] -> loss; returns (x, opt, train_op, w)."""
  x = tf1.placeholder(tf.float32, [4, 2], name="x")
  loss, _, w = _dense_model(x)
  global_step = tf1.train.get_or_create_global_step()
  opt = optimizer_lib.SkipNonFiniteOptimizer(
      tf1.train.GradientDescentOptimizer(0.1))
  return x, opt, opt.minimize(loss, global_step), w


class WrapperReplayTest(tf.test.TestCase):

  def testPlainLoopReplaysTheSkippedFeedDict(self):
    with tf.Graph().as_default():
      x, opt, train_op, w = _wrapped_step()
      report = opt.report_fetches(train_op)
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        findings = []
        for batch in (GOOD, _nan_rows([2]), GOOD):
          feed_dict = {x: batch}
          _, values = sess.run([train_op, report], feed_dict)
          if opt.describe_skip(values):
            before = sess.run(w)
            findings.append(opt.replay(sess, feed_dict))
            self.assertAllEqual(before, sess.run(w))  # Nothing trained.
        self.assertTrue(opt.replay(sess, {x: GOOD}).finite)
    self.assertEqual(1, len(findings))
    self.assertEqual(
        "input holds NaN/Inf: rows [2]; first non-finite: layer/MatMul "
        "(forward)", replay.describe(findings[0]))
    self.assertGreater(findings[0].ops_checked, 5)

  def testFinalizedGraphNeedsBuildReplayFirst(self):
    with tf.Graph().as_default() as graph:
      x, opt, train_op, _ = _wrapped_step()
      graph.finalize()
      with self.session() as sess:
        with self.assertRaisesRegex(ValueError, "call opt.build_replay"):
          opt.replay(sess, {x: GOOD})
    with tf.Graph().as_default() as graph:
      x, opt, train_op, _ = _wrapped_step()
      opt.build_replay()  # Inputs: the placeholders, here x.
      init = tf1.global_variables_initializer()
      graph.finalize()
      with self.session() as sess:
        sess.run(init)
        sess.run(train_op, {x: _nan_rows([0])})
        finding = opt.replay(sess, {"x:0": _nan_rows([0])})
    self.assertEqual({"x:0": [0]}, finding.nonfinite_inputs)

  def testReplayBeforeAnyStepIsAnError(self):
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.GradientDescentOptimizer(0.1))
    with self.assertRaisesRegex(ValueError, "apply_gradients"):
      opt.replay(None, {})

  def testReportHookAppendsOneRecordPerSkip(self):
    log_path = self.get_temp_dir() + "/skips.jsonl"
    with tf.Graph().as_default():
      x, opt, train_op, w = _wrapped_step()
      hook = opt.report_hook(skip_log_path=log_path, replay=True)
      batches = [GOOD, _nan_rows([1]), GOOD, _nan_rows([0, 3])]
      with tf1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        for batch in batches:
          sess.run(train_op, {x: batch})
        sess.run(w)  # Runs no step: no record.
    records = skip_log.read(log_path)
    self.assertEqual([1, 3], [r["step"] for r in records])
    self.assertEqual(2, len(hook.reports))
    for record, rows in zip(records, ([1], [0, 3])):
      self.assertEqual(0, record["worker"])
      self.assertEqual("nonfinite", record["reason"])
      self.assertEqual([{"index": 0, "device": "", "nonfinite": True,
                         "variables": ["w"]}], record["towers"])
      self.assertEqual({"x:0": rows}, record["replay"]["nonfinite_inputs"])
      self.assertEqual("layer/MatMul", record["replay"]["first_op"])
      self.assertIn("first non-finite: layer/MatMul (forward)",
                    record["replay"]["summary"])

  def testReportHookRecordsTowersAndTheirDevices(self):
    log_path = self.get_temp_dir() + "/towers.jsonl"
    with tf.Graph().as_default():
      inputs, tower_grads = [], []
      for i, device in enumerate(["/device:CPU:0", "/device:CPU:1"]):
        with tf.device(device), tf1.name_scope("tower_%d" % i):
          x = tf1.placeholder(tf.float32, [3], name="x")
          with tf1.variable_scope("", reuse=tf1.AUTO_REUSE):
            loss, var_list = test_util.model(x)
          tower_grads.append(list(zip(tf.gradients(loss, var_list),
                                      var_list)))
        inputs.append(x)
      average = [((a + b) / 2.0, v) for (a, v), (b, _) in zip(*tower_grads)]
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.apply_gradients(
          average, tf1.train.get_or_create_global_step(),
          tower_grads_and_vars=tower_grads)
      hook = opt.report_hook(skip_log_path=log_path, replay=True)
      config = tf1.ConfigProto(device_count={"CPU": 2})
      with tf1.train.MonitoredTrainingSession(hooks=[hook],
                                              config=config) as sess:
        sess.run(train_op, {inputs[0]: test_util.GOOD_X,
                            inputs[1]: test_util.NAN_X})
    record, = skip_log.read(log_path)
    self.assertEqual([
        {"index": 0, "device": "/device:CPU:0", "nonfinite": False,
         "variables": []},
        {"index": 1, "device": "/device:CPU:1", "nonfinite": True,
         "variables": ["model/w", "model/b"]}], record["towers"])
    self.assertEqual({"tower_1/x:0": [1]},
                     record["replay"]["nonfinite_inputs"])
    self.assertTrue(record["replay"]["first_op"].startswith("tower_1/"),
                    record["replay"]["first_op"])

  def testAFailedReplayIsRecordedAndTheRunGoesOn(self):

    class FailingProbe(object):

      def run(self, session, feed_dict):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM\nmore")

    log_path = self.get_temp_dir() + "/failed.jsonl"
    with tf.Graph().as_default():
      x, opt, train_op, _ = _wrapped_step()
      hook = opt.report_hook(skip_log_path=log_path, replay=True)
      hook._probe = FailingProbe()  # pylint: disable=protected-access
      with tf1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        sess.run(train_op, {x: _nan_rows([1])})
        sess.run(train_op, {x: GOOD})
    record, = skip_log.read(log_path)
    self.assertEqual({"error": "OOM"}, record["replay"])

  def testReportHookWithoutReplayOrLogIsTheReportHook(self):
    with tf.Graph().as_default():
      _, opt, _, _ = _wrapped_step()
      self.assertNotIsInstance(opt.report_hook(), wrapper_replay.SkipLogHook)


if __name__ == "__main__":
  tf.test.main()
