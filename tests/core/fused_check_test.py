"""Good steps pay for the decision only (issue 16, item 3).

The guard decides with fused checks (`nonfinite.any_nonfinite`: a few
kernels however many gradients) and computes the report's per-tensor flags
in its skip branch only; the wrapper's report adds one fused check per
tower. The reports still name every bad variable and tower.
"""

from unittest import mock

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import guard
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import optimizer as optimizer_lib
from bench import executed_ops

tf1 = tf.compat.v1

_NAN = float("nan")


def _executed(metadata, op_type):
  """How many nodes of `op_type` a traced run executed."""
  return sum(1 for dev in metadata.step_stats.dev_stats
             for node in dev.node_stats
             if " = %s(" % op_type in node.timeline_label)


def _traced_run(sess, fetches, feed):
  metadata = tf1.RunMetadata()
  values = sess.run(
      fetches, feed,
      options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
      run_metadata=metadata)
  return values, metadata


class GoodStepTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.parameters(True, False)
  def testGoodStepRunsFusedChecksAndASkipNamesTheVariables(self, resource):
    num_variables = 12
    with tf.Graph().as_default():
      bad = tf1.placeholder(tf.int32, [])  # The variable made NaN, or -1.
      pairs = []
      for i in range(num_variables):
        # Two shapes (one fused check each) and a scalar (flattened in).
        shape = [2, 3] if i % 2 else [4, 3]
        v = tf1.Variable(tf.ones(shape if i else []), name="v%d" % i,
                         use_resource=resource)
        grad = tf.where(tf.equal(bad, i), tf.fill(tf.shape(v), _NAN),
                        tf.ones_like(v))
        pairs.append((grad, v))
      moving = tf1.Variable([0.0, 0.0], name="moving", trainable=False,
                            use_resource=resource)
      update = tf1.assign(moving, tf.where(tf.equal(bad, 99), [_NAN, 1.0],
                                           [1.0, 1.0]))
      result = guard.guarded_apply(
          pairs, tf1.train.GradientDescentOptimizer(0.1).apply_gradients,
          update_ops=[update])
      fetches = [result.train_op, result.applied, result.nonfinite_flags,
                 result.update_flags]
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(result.train_op, {bad: -1})  # The first run initialises.
        (_, applied, flags, update_flags), metadata = _traced_run(
            sess, fetches, {bad: -1})
        self.assertTrue(applied)
        self.assertFalse(flags.any())
        self.assertFalse(update_flags.any())
        # The [k, 3] gradients concatenated, the scalar, the statistic:
        # never one check per gradient.
        self.assertLessEqual(_executed(metadata, "IsFinite"), 3)
        for i in (0, 5, 11):
          _, applied, flags, update_flags = sess.run(fetches, {bad: i})
          self.assertFalse(applied, i)
          self.assertEqual(["v%d" % i],
                           [n for n, f in zip(result.variable_names, flags)
                            if f])
          self.assertFalse(update_flags.any())
        before = sess.run(moving)
        _, applied, flags, update_flags = sess.run(fetches, {bad: 99})
        self.assertFalse(applied)
        self.assertFalse(flags.any())
        self.assertEqual([True], list(update_flags))
        # Checked before the skip branch restored it.
        self.assertAllEqual(before, sess.run(moving))


class WrapperReportTest(tf.test.TestCase):

  def testReportWithTowersRunsOneFusedCheckPerTowerOnAGoodStep(self):
    num_towers, num_variables = 3, 8
    with tf.Graph().as_default():
      scale = tf1.placeholder(tf.float32, [num_towers])
      var_list = [tf1.get_variable("w%d" % i, initializer=tf.ones([2, 2]))
                  for i in range(num_variables)]
      towers = [list(zip(tf.gradients(tf.add_n([tf.reduce_sum(w * scale[t])
                                                for w in var_list]),
                                      var_list), var_list))
                for t in range(num_towers)]
      average = [(tf.add_n([tower[j][0] for tower in towers]) / num_towers,
                  v) for j, v in enumerate(var_list)]
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.apply_gradients(average, tower_grads_and_vars=towers)
      report = opt.report_fetches(train_op)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run([train_op, report], {scale: [1.0] * num_towers})
        (_, values), metadata = _traced_run(sess, [train_op, report],
                                            {scale: [1.0] * num_towers})
        self.assertIsNone(opt.describe_skip(values))
        # The decision's fused check and one per tower.
        self.assertLessEqual(_executed(metadata, "IsFinite"), num_towers + 1)
        _, values = sess.run([train_op, report], {scale: [1.0, _NAN, 1.0]})
    self.assertEqual(
        "skipped step 2: non-finite gradients in tower 1; variables: "
        "w0, w1, w2, w3, w4, ... (+3 more, 8 in all)",
        opt.describe_skip(values))


class FusedCheckTest(tf.test.TestCase):

  def testBigTensorsAreCheckedAloneAndNoCopyExceedsTheLimit(self):
    with tf.Graph().as_default() as graph, mock.patch.object(
        nonfinite, "MAX_FUSED_ELEMENTS", 8):
      value = tf1.placeholder(tf.float32, [])
      where = tf1.placeholder(tf.int32, [])
      shapes = [[1, 2], [2, 2], [3, 2], [2, 2], [5, 2], [3]]
      grads = [tf.where(tf.equal(where, i), tf.fill(s, value), tf.ones(s))
               for i, s in enumerate(shapes)]
      # Values of unknown size (as an IndexedSlices' often are).
      grads.append(tf.IndexedSlices(
          tf1.placeholder_with_default(tf.ones([2, 2]), [None, 2]),
          tf.constant([0, 1]), tf.constant([4, 2])))
      flag = nonfinite.any_nonfinite(grads)
      concats = [op for op in graph.get_operations() if op.type == "ConcatV2"]
      self.assertNotEmpty(concats)
      for op in concats:
        self.assertLessEqual(op.outputs[0].shape.num_elements(), 8, op.name)
        for t in op.inputs[:-1]:
          self.assertIsNotNone(t.shape.num_elements(), op.name)
      with self.cached_session() as sess:
        self.assertFalse(sess.run(flag, {value: 1.0, where: -1}))
        for i in range(len(shapes)):
          for v in (_NAN, np.inf, -np.inf):
            self.assertTrue(sess.run(flag, {value: v, where: i}), (i, v))
        self.assertFalse(sess.run(flag, {value: 3e38, where: 4}))

  def testEachDeviceChecksItsOwnTensors(self):
    config = tf1.ConfigProto(device_count={"CPU": 2})
    with tf.Graph().as_default() as graph:
      grads = []
      for d in (0, 1, 0, 1):
        with tf.device("/cpu:%d" % d):
          grads.append(tf.ones([2, 3]) * 2.0)
      flag = nonfinite.any_nonfinite(grads)
      concats = [op for op in graph.get_operations() if op.type == "ConcatV2"]
      self.assertLen(concats, 2)
      for op in concats:
        devices = {t.device for t in op.inputs[:-1]}
        self.assertLen(devices, 1)
        self.assertEqual(op.inputs[0].op.colocation_groups(),
                         op.colocation_groups())
      with tf1.Session(config=config) as sess:
        self.assertFalse(sess.run(flag))


class StatisticsCostTest(tf.test.TestCase):
  """The forward pass's written statistics cost a couple of nodes each."""

  def _extra_nodes(self, num_statistics):
    """Executed nodes of a guarded good step beyond its unguarded twin."""
    counts = []
    for guarded in (False, True):
      with tf.Graph().as_default():
        weights = tf1.get_variable("w", initializer=tf.ones([3]))
        loss = tf.reduce_sum(weights * weights)
        updates = []
        for i in range(num_statistics):
          moving = tf1.get_variable("bn%d/moving_mean" % i,
                                    initializer=tf.zeros([4 + i % 3]),
                                    trainable=False)
          updates.append(tf1.assign_sub(moving, 0.1 * (moving - loss)))
        sgd = tf1.train.GradientDescentOptimizer(0.1)
        pairs = sgd.compute_gradients(loss)
        if guarded:
          train_op = guard.guarded_apply(pairs, sgd.apply_gradients,
                                         update_ops=updates).train_op
        else:
          with tf1.control_dependencies(updates):
            train_op = sgd.apply_gradients(pairs)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          sess.run(train_op)
          counts.append(executed_ops.executed_nodes(sess, train_op))
    return counts[1] - counts[0]

  def testEachStatisticAddsAtMostTwoNodesToAGoodStep(self):
    # Its read for the fused check (which the flat shadow's commit reuses)
    # and the Switch of its handle for the skip branch's restore; with a
    # shadow variable of its own it cost six (read, shadow handle, two
    # Switches, read and assign in the apply branch).
    few, many = self._extra_nodes(4), self._extra_nodes(24)
    self.assertLessEqual((many - few) / 20.0, 2.0, (few, many))


if __name__ == "__main__":
  tf.test.main()
