"""Tests for tf1_safe_train.core.guard: detection, the apply/skip decision."""

import re

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import guard
from tf1_safe_train.core import nonfinite

tf1 = tf.compat.v1

_NAN = float("nan")
_INF = float("inf")
_BAD_VALUES = (_NAN, _INF, -_INF)


def _flag(grad, feed=None):
  """Runs `is_nonfinite(grad)` in a fresh session of grad's graph."""
  with tf1.Session(graph=grad.graph) as sess:
    return sess.run(nonfinite.is_nonfinite(grad), feed_dict=feed)


class IsNonfiniteTest(tf.test.TestCase):

  def testNotFlaggedWhenAllFinite(self):
    with tf.Graph().as_default():
      self.assertFalse(_flag(tf.constant([[1.0, -2.0, 0.0], [1e-30, 5.0, 6.0]])))

  def testFlagsNanAndInfAnywhereInDense(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [2, 3])
      flag = nonfinite.is_nonfinite(x)
      cases = 0
      with tf1.Session() as sess:
        for bad in _BAD_VALUES:
          for i in range(2):
            for j in range(3):
              value = np.ones([2, 3], np.float32)
              value[i, j] = bad
              self.assertTrue(sess.run(flag, {x: value}), (bad, i, j))
              cases += 1
        self.assertFalse(sess.run(flag, {x: np.ones([2, 3], np.float32)}))
      self.assertEqual(18, cases)

  def testSameTensorIsCheckedOnceAndFreeOfControlDependencies(self):
    with tf.Graph().as_default() as graph:
      x = tf1.placeholder(tf.float32, [3])
      first = nonfinite.is_nonfinite(x)
      with tf1.control_dependencies([tf.no_op(name="unrelated")]):
        again = nonfinite.is_nonfinite(x)
      self.assertIs(first, again)
      y = x * 2.0
      other = nonfinite.is_nonfinite(y)
      self.assertIsNot(first, other)
      checks = [op for op in graph.get_operations() if op.type == "IsFinite"]
      self.assertLen(checks, 2)
      # A check built under the caller's control dependencies would wait for
      # them; it reads nothing but the tensor.
      with tf1.control_dependencies([tf.no_op(name="before")]):
        z = tf.identity(x)
        flag = nonfinite.is_nonfinite(z)
      for op in graph.get_operations():
        if op.name.startswith(flag.op.name.split("/")[0]):
          self.assertEmpty(op.control_inputs, op.name)
      with tf1.Session() as sess:
        self.assertTrue(sess.run(again, {x: [1.0, _NAN, 2.0]}))
        self.assertFalse(sess.run(again, {x: [1.0, 3.0, 2.0]}))

  def testInsideACondTheCheckBelongsToTheBranch(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      pred = tf1.placeholder(tf.bool, [])
      # Asked first inside a branch: that flag must not be handed out again
      # outside it (a branch's tensor cannot be used outside its cond).
      inside = tf.cond(pred, lambda: nonfinite.is_nonfinite(x),
                       lambda: tf.constant(False))
      outside = nonfinite.is_nonfinite(x)
      both = tf.logical_and(outside, tf.logical_not(inside))
      with tf1.Session() as sess:
        bad = [1.0, _INF, 2.0]
        self.assertTrue(sess.run(outside, {x: bad}))
        self.assertTrue(sess.run(inside, {x: bad, pred: True}))
        self.assertFalse(sess.run(inside, {x: bad, pred: False}))
        self.assertTrue(sess.run(both, {x: bad, pred: False}))

  def testFlagsIndexedSlicesFromEmbeddingLookupGradient(self):
    with tf.Graph().as_default():
      table = tf1.get_variable("table", initializer=tf.ones([5, 2]))
      ids = tf.constant([1, 3])
      scale = tf1.placeholder(tf.float32, [])
      loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * scale)
      grad, = tf.gradients(loss, [table])
      self.assertIsInstance(grad, tf.IndexedSlices)
      flag = nonfinite.is_nonfinite(grad)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        self.assertFalse(sess.run(flag, {scale: 2.0}))
        for bad in _BAD_VALUES:
          self.assertTrue(sess.run(flag, {scale: bad}), bad)

  def testFlagsIndexedSlicesFromGatherGradient(self):
    with tf.Graph().as_default():
      params = tf1.get_variable("params", initializer=tf.ones([4, 3]))
      weights = tf1.placeholder(tf.float32, [2, 3])
      loss = tf.reduce_sum(tf.gather(params, [0, 2]) * weights)
      grad, = tf.gradients(loss, [params])
      self.assertIsInstance(grad, tf.IndexedSlices)
      flag = nonfinite.is_nonfinite(grad)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        good = np.ones([2, 3], np.float32)
        self.assertFalse(sess.run(flag, {weights: good}))
        bad = good.copy()
        bad[1, 2] = _NAN
        self.assertTrue(sess.run(flag, {weights: bad}))

  def testIndexedSlicesChecksOnlyValues(self):
    # A huge dense_shape or indices are not gradient values; only .values are.
    with tf.Graph().as_default():
      values = tf1.placeholder(tf.float32, [2, 2])
      slices = tf.IndexedSlices(values, tf.constant([0, 7]),
                                tf.constant([8, 2]))
      flag = nonfinite.is_nonfinite(slices)
      with tf1.Session() as sess:
        self.assertFalse(sess.run(flag, {values: [[1.0, 2.0], [3.0, 4.0]]}))
        self.assertTrue(sess.run(flag, {values: [[1.0, 2.0], [_INF, 4.0]]}))

  def testNoneGradientsAreIgnored(self):
    with tf.Graph().as_default():
      bad = tf.constant([1.0, _NAN])
      good = tf.constant([1.0, 2.0])
      flags = nonfinite.nonfinite_flags([None, bad, None, good])
      only_none = nonfinite.nonfinite_flags([None, None])
      with tf1.Session() as sess:
        flags_value, none_value = sess.run([flags, only_none])
      self.assertTrue(np.array_equal([True, False], flags_value))
      self.assertEqual((0,), none_value.shape)
      self.assertEqual(tf.bool, only_none.dtype)

  def testOneFlagPerGradientNotPerElement(self):
    with tf.Graph().as_default():
      grads = [tf.constant([_NAN, _NAN, _INF]), tf.constant([1.0]),
               tf.constant([[-_INF]]), tf.constant(3.0)]
      flags = nonfinite.nonfinite_flags(grads)
      with tf1.Session() as sess:
        self.assertAllEqual([True, False, True, False], sess.run(flags))

  def testLargeFiniteFloat32IsNotFlagged(self):
    with tf.Graph().as_default():
      near_max = tf.constant([3e38, 3e38, -3e38], tf.float32)
      overflows = tf.constant([3e38, 3e38, 3e38], tf.float32)
      with tf1.Session() as sess:
        flags, total, norm = sess.run([
            nonfinite.nonfinite_flags([near_max, overflows]),
            tf.reduce_sum(overflows),
            tf.linalg.global_norm([near_max]),
        ])
      # The traps an inexact check falls into: the sum and the norm overflow.
      self.assertEqual(np.inf, total)
      self.assertEqual(np.inf, norm)
      self.assertTrue(np.array_equal([False, False], flags))

  def testFloat16NearMaxIsNotFlaggedButInfIs(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float16, [3])
      flag = nonfinite.is_nonfinite(x)
      with tf1.Session() as sess:
        near_max = np.array([65504, 65504, -60000], np.float16)
        self.assertEqual(np.inf, sess.run(tf.reduce_sum(x), {x: near_max}))
        self.assertFalse(sess.run(flag, {x: near_max}))
        for bad in _BAD_VALUES:
          self.assertTrue(
              sess.run(flag, {x: np.array([1, bad, 2], np.float16)}), bad)

  def testBfloat16NearMaxIsNotFlaggedButInfIs(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      flag = nonfinite.is_nonfinite(tf.cast(x, tf.bfloat16))
      with tf1.Session() as sess:
        self.assertFalse(sess.run(flag, {x: [3e38, 3e38, -3e38]}))
        self.assertFalse(sess.run(flag, {x: [1.0, 2.0, 3.0]}))
        for bad in _BAD_VALUES:
          self.assertTrue(sess.run(flag, {x: [1.0, bad, 2.0]}), bad)

  def testFloat64(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float64, [2])
      flag = nonfinite.is_nonfinite(x)
      with tf1.Session() as sess:
        self.assertFalse(sess.run(flag, {x: [1e308, -1e308]}))
        self.assertTrue(sess.run(flag, {x: [1e308, _NAN]}))


class AnyNonfiniteTest(tf.test.TestCase):

  def testOneFlagOverMixedShapesDtypesAndSlices(self):
    with tf.Graph().as_default():
      value = tf1.placeholder(tf.float32, [])
      half = tf1.placeholder(tf.float16, [])

      def grads(where):
        # Two [k, 3] tensors (one group), a [2, 2] and a scalar (flattened),
        # a float16 vector, IndexedSlices and a None.
        pick = lambda i, v: tf.fill(tf.shape(v), value) if i == where else v
        return [pick(0, tf.ones([2, 3])), pick(1, tf.ones([4, 3])),
                pick(2, tf.ones([2, 2])), pick(3, tf.constant(1.0)),
                tf.fill([3], half) if where == 4 else tf.ones([3], tf.float16),
                tf.IndexedSlices(pick(5, tf.ones([2, 3])),
                                 tf.constant([0, 0]), tf.constant([4, 3])),
                None]
      flags = [nonfinite.any_nonfinite(grads(w)) for w in range(-1, 6)]
      with self.cached_session() as sess:
        for v in (1.0, 3e38, float("nan"), float("inf"), -float("inf")):
          # float16 gets the non-finite values only (3e38 would be Inf).
          got = sess.run(flags, {value: v, half: 1.0 if np.isfinite(v) else v})
          bad = not np.isfinite(v)
          self.assertEqual([False] + [bad] * 6, got, v)
        self.assertTrue(sess.run(flags[5], {value: 1.0, half: np.inf}))

  def testNoGradientIsFinite(self):
    with tf.Graph().as_default(), self.cached_session() as sess:
      self.assertFalse(sess.run(nonfinite.any_nonfinite([None])))


class SumDuplicatesTest(tf.test.TestCase):

  def testSumsValuesOfRepeatedIndicesInFirstSeenOrder(self):
    with tf.Graph().as_default():
      slices = tf.IndexedSlices(
          tf.constant([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]]),
          tf.constant([3, 1, 3]), tf.constant([5, 2]))
      summed = nonfinite.sum_duplicates(slices)
      self.assertIsInstance(summed, tf.IndexedSlices)
      with tf1.Session() as sess:
        values, indices, shape = sess.run(
            [summed.values, summed.indices, summed.dense_shape])
    self.assertAllEqual([3, 1], indices)
    self.assertAllEqual([[101.0, 202.0], [10.0, 20.0]], values)
    self.assertAllEqual([5, 2], shape)

  def testUniqueIndicesKeepTheirValuesBitForBit(self):
    # (Not subnormals, which the sum flushes to zero on CPU, as the wrapped
    # optimizer's own sum of the same indices does.)
    values = np.array([[0.1, -3e-38], [7e37, 1.0 / 3]], np.float32)
    with tf.Graph().as_default():
      summed = nonfinite.sum_duplicates(
          tf.IndexedSlices(tf.constant(values), tf.constant([4, 2])))
      with tf1.Session() as sess:
        got, indices = sess.run([summed.values, summed.indices])
    self.assertTrue(np.array_equal(values, got))
    self.assertAllEqual([4, 2], indices)

  def testDenseAndNoneAreUnchanged(self):
    with tf.Graph().as_default():
      dense = tf.constant([1.0])
      self.assertIs(dense, nonfinite.sum_duplicates(dense))
      self.assertIsNone(nonfinite.sum_duplicates(None))

  def testRepeatedIndicesWhoseSumOverflowsAreSkipped(self):
    # Each value is finite; the row the optimizer would apply is not.
    with tf.Graph().as_default():
      table = tf1.get_variable("table", initializer=tf.zeros([3, 2]))
      values = tf1.placeholder(tf.float32, [2, 2])
      slices = tf.IndexedSlices(values, tf.constant([1, 1]),
                                tf.constant([3, 2]))
      seen = []

      def _apply(grads_and_vars):
        seen.append(grads_and_vars[0][0])
        return tf1.train.GradientDescentOptimizer(1.0).apply_gradients(
            grads_and_vars)

      result = guard.guarded_apply([(slices, table)], _apply)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        _, applied, indices = sess.run(
            [result.train_op, result.applied, seen[0].indices],
            {values: np.full([2, 2], 1.0, np.float32)})
        self.assertTrue(applied)
        self.assertAllEqual([1], indices)  # apply_fn gets the sums
        before = sess.run(table)
        self.assertAllEqual([[0, 0], [-2, -2], [0, 0]], before)
        _, applied = sess.run([result.train_op, result.applied],
                              {values: np.full([2, 2], 2e38, np.float32)})
        self.assertFalse(applied)
        self.assertTrue(np.array_equal(before, sess.run(table)))


class _Step(object):
  """One variable `w`, a fed gradient, and a guarded SGD step over it."""

  def __init__(self, learning_rate=0.1, **kwargs):
    self.w = tf1.get_variable(
        "w", initializer=tf.constant([1.0, -2.0, 3.0]), use_resource=True)
    self.grad = tf1.placeholder(tf.float32, [3], name="grad")
    self.opt = tf1.train.GradientDescentOptimizer(learning_rate)
    self.result = guard.guarded_apply(
        [(self.grad, self.w)], lambda gv: self.opt.apply_gradients(gv),
        **kwargs)


_GOOD = np.array([0.3, -0.7, 0.11], np.float32)
_NAN_GRAD = np.array([0.3, _NAN, 0.11], np.float32)


class GuardedApplyTest(tf.test.TestCase):

  def testAppliesWhenAllFinite(self):
    with tf.Graph().as_default():
      step = _Step()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        _, applied = sess.run([step.result.train_op, step.result.applied],
                              {step.grad: _GOOD})
        w = sess.run(step.w)
      self.assertTrue(applied)
      self.assertAllClose([0.97, -1.93, 2.989], w)

  def testAppliedStepEqualsPlainApplyBitForBit(self):
    with tf.Graph().as_default():
      step = _Step()
      plain_w = tf1.get_variable(
          "plain_w", initializer=tf.constant([1.0, -2.0, 3.0]),
          use_resource=True)
      plain = tf1.train.GradientDescentOptimizer(0.1).apply_gradients(
          [(step.grad, plain_w)])
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(3):
          sess.run(step.result.train_op, {step.grad: _GOOD})
          sess.run(plain, {step.grad: _GOOD})
        guarded, expected = sess.run([step.w, plain_w])
      self.assertFalse(np.array_equal([1.0, -2.0, 3.0], guarded))
      self.assertTrue(np.array_equal(expected, guarded), (expected, guarded))

  def testSkipsWhenGradHasNanOrInf(self):
    with tf.Graph().as_default():
      step = _Step()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(step.result.train_op, {step.grad: _GOOD})
        before = sess.run(step.w)
        for bad in _BAD_VALUES:
          grad = _GOOD.copy()
          grad[2] = bad
          _, applied = sess.run([step.result.train_op, step.result.applied],
                                {step.grad: grad})
          self.assertFalse(applied, bad)
          self.assertTrue(np.array_equal(before, sess.run(step.w)), bad)

  def testCountersCountAppliedSkippedAndConsecutive(self):
    with tf.Graph().as_default():
      step = _Step()
      counters = step.result.counters
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        seen = []
        for grad in (_GOOD, _NAN_GRAD, _NAN_GRAD, _GOOD, _NAN_GRAD):
          _, values = sess.run([step.result.train_op, counters],
                               {step.grad: grad})
          seen.append(tuple(values))
        stored = sess.run(list(counters_lib.skip_counters()))
    # (applied, skipped, consecutive) after each step; consecutive resets to
    # 0 after the applied 4th step.
    self.assertEqual([(1, 0, 0), (1, 1, 1), (1, 2, 2), (2, 2, 0), (2, 3, 1)],
                     seen)
    self.assertEqual([2, 3, 1], stored)

  def testGlobalStepAdvancesOnEveryStepByDefault(self):
    with tf.Graph().as_default():
      global_step = tf1.train.get_or_create_global_step()
      step = _Step(global_step=global_step)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for grad in (_GOOD, _NAN_GRAD, _NAN_GRAD):
          sess.run(step.result.train_op, {step.grad: grad})
        self.assertEqual(3, sess.run(global_step))

  def testGlobalStepOnlyOnAppliedStepsWhenIncrementOnSkipIsFalse(self):
    with tf.Graph().as_default():
      global_step = tf1.train.get_or_create_global_step()
      step = _Step(global_step=global_step,
                   increment_global_step_on_skip=False)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        values = []
        for grad in (_GOOD, _NAN_GRAD, _NAN_GRAD, _GOOD):
          sess.run(step.result.train_op, {step.grad: grad})
          values.append(sess.run(global_step))
        self.assertEqual([1, 1, 1, 2], values)

  def testExtraNonfiniteForcesSkip(self):
    with tf.Graph().as_default():
      extra = tf1.placeholder(tf.bool, [])
      step = _Step(extra_nonfinite=[extra])
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        before = sess.run(step.w)
        _, applied = sess.run([step.result.train_op, step.result.applied],
                              {step.grad: _GOOD, extra: True})
        self.assertFalse(applied)
        self.assertTrue(np.array_equal(before, sess.run(step.w)))
        _, applied = sess.run([step.result.train_op, step.result.applied],
                              {step.grad: _GOOD, extra: False})
        self.assertTrue(applied)
        self.assertFalse(np.array_equal(before, sess.run(step.w)))

  def testRollsBackUpdateOpsOnSkipAndKeepsThemOnApply(self):
    with tf.Graph().as_default():
      batch = tf1.placeholder(tf.float32, [2])
      moving_mean = tf1.get_variable(
          "moving_mean", initializer=tf.constant([0.5, -0.25]),
          trainable=False, use_resource=True)
      update = tf1.assign_sub(moving_mean, (moving_mean - batch) * (1 - 0.9))
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
      grad = batch * 2.0  # a NaN batch gives a NaN gradient
      result = guard.guarded_apply(
          [(grad, w)],
          tf1.train.GradientDescentOptimizer(0.1).apply_gradients,
          update_ops=tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = sess.run(moving_mean)
        # A NaN batch: the update op wrote NaN, the skip restored it.
        _, applied = sess.run([result.train_op, result.applied],
                              {batch: [_NAN, 1.0]})
        self.assertFalse(applied)
        after_skip = sess.run(moving_mean)
        self.assertTrue(np.array_equal(initial, after_skip), after_skip)
        # A good batch: the new moving mean is kept.
        _, applied = sess.run([result.train_op, result.applied],
                              {batch: [1.5, 0.75]})
        self.assertTrue(applied)
        after_apply = sess.run(moving_mean)
        self.assertAllClose([0.6, -0.15], after_apply)
        # Another NaN batch goes back to the last applied value, not the
        # initial one.
        sess.run(result.train_op, {batch: [_INF, _NAN]})
        self.assertTrue(np.array_equal(after_apply, sess.run(moving_mean)))

  def testUpdateOpThatWritesATrainedWeightKeepsTheAppliedValue(self):
    # A max-norm clip as an update op: it writes the weight before the
    # decision, the update trains it after. A skip must take it back to
    # its value after the last applied update, not to the clipped one.
    with tf.Graph().as_default():
      grad = tf1.placeholder(tf.float32, [2])
      w = tf1.get_variable("w", initializer=tf.constant([3.0, 4.0]))
      clip = tf1.assign(w, tf.clip_by_norm(w, 4.0))
      result = guard.guarded_apply(
          [(grad, w)],
          tf1.train.GradientDescentOptimizer(1.0).apply_gradients,
          update_ops=[clip])
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(result.train_op, {grad: [-1.0, -1.0]})
        applied = sess.run(w)  # [3.4, 4.2]: clipped to norm 4, then +1.
        self.assertAllClose([3.4, 4.2], applied)
        _, was_applied = sess.run([result.train_op, result.applied],
                                  {grad: [_NAN, 0.0]})
        self.assertFalse(was_applied)
        self.assertTrue(np.array_equal(applied, sess.run(w)))

  def testNonFiniteStatisticSkipsEvenBehindFiniteGradients(self):
    for use_resource in (True, False):
      with tf.Graph().as_default():
        batch = tf1.placeholder(tf.float32, [2])
        moving_var = tf1.get_variable(
            "moving_var", initializer=tf.constant([1.0, 2.0]),
            trainable=False, use_resource=use_resource)
        # A variance computed in a way that can overflow: 1e20**2 is Inf.
        update = tf1.assign_sub(
            moving_var, (moving_var - tf.square(batch)) * (1 - 0.9))
        w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0]),
                             use_resource=use_resource)
        grad = tf.constant([0.5, 0.5])  # always finite
        result = guard.guarded_apply(
            [(grad, w)],
            tf1.train.GradientDescentOptimizer(0.1).apply_gradients,
            update_ops=[update])
        self.assertEqual(["moving_var"], result.update_variable_names)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          _, applied, flags = sess.run(
              [result.train_op, result.applied, result.update_flags],
              {batch: [1.0, 1.0]})
          self.assertTrue(applied)
          self.assertEqual([False], list(flags))
          before = sess.run([moving_var, w])
          _, applied, flags, grad_flags = sess.run(
              [result.train_op, result.applied, result.update_flags,
               result.nonfinite_flags], {batch: [1e20, 1.0]})
          self.assertFalse(applied, use_resource)
          self.assertEqual([True], list(flags))
          self.assertEqual([False], list(grad_flags))
          after = sess.run([moving_var, w])
          for b, a in zip(before, after):
            self.assertTrue(np.array_equal(b, a), (use_resource, b, a))

  def testGradientsOnTwoVirtualCpuDevices(self):
    config = tf1.ConfigProto(device_count={"CPU": 2})
    with tf.Graph().as_default():
      scale = tf1.placeholder(tf.float32, [])
      with tf.device("/cpu:0"):
        a = tf1.get_variable("a", initializer=tf.constant([1.0, 2.0]))
        loss_a = tf.reduce_sum(a * a)
      with tf.device("/cpu:1"):
        b = tf1.get_variable("b", initializer=tf.constant([3.0, 4.0]))
        loss_b = tf.reduce_sum(b * scale)
      grads_and_vars = list(zip(
          tf.gradients(loss_a + loss_b, [a, b]),
          [a, b]))
      result = guard.guarded_apply(
          grads_and_vars,
          tf1.train.GradientDescentOptimizer(0.5).apply_gradients)
      self.assertIn("CPU:0", a.device)
      self.assertIn("CPU:1", b.device)
      # Each check is colocated with its gradient.
      checks = [op for op in tf1.get_default_graph().get_operations()
                if op.type == "IsFinite"]
      self.assertLen(checks, 2)
      for check, (grad, _) in zip(checks, grads_and_vars):
        self.assertEqual(grad.op.colocation_groups(),
                         check.colocation_groups())
      with tf1.Session(config=config) as sess:
        self.assertLen([d for d in sess.list_devices()
                        if d.device_type == "CPU"], 2)
        sess.run(tf1.global_variables_initializer())
        _, flags = sess.run([result.train_op, result.nonfinite_flags],
                            {scale: _NAN})
        self.assertTrue(np.array_equal([False, True], flags))
        a_value, b_value = sess.run([a, b])
        self.assertTrue(np.array_equal(np.float32([1.0, 2.0]), a_value))
        self.assertTrue(np.array_equal(np.float32([3.0, 4.0]), b_value))
        metadata = tf1.RunMetadata()
        _, applied = sess.run(
            [result.train_op, result.applied], {scale: 1.0},
            options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
            run_metadata=metadata)
        self.assertTrue(applied)
        self.assertAllClose([[0.0, 0.0], [2.5, 3.5]], sess.run([a, b]))
      # Each check ran on its gradient's device.
      is_finite_devices = sorted(
          tf.DeviceSpec.from_string(dev.device).device_index
          for dev in metadata.step_stats.dev_stats
          for node in dev.node_stats
          if re.search(r"/IsFinite(_\d+)?$", node.node_name))
      self.assertEqual([0, 1], is_finite_devices)

  def testRaisesValueErrorWithoutGradients(self):
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=tf.constant([1.0]))
      opt = tf1.train.GradientDescentOptimizer(0.1)
      with self.assertRaisesRegex(ValueError, "no gradient"):
        guard.guarded_apply([(None, w)], opt.apply_gradients)
      with self.assertRaisesRegex(ValueError, "no gradient"):
        guard.guarded_apply([], opt.apply_gradients)

  def testFlagsAndVariableNamesNameTheBadVariable(self):
    with tf.Graph().as_default():
      with tf1.variable_scope("net"):
        a = tf1.get_variable("a", initializer=tf.constant([1.0]))
        b = tf1.get_variable("b", initializer=tf.constant([1.0]))
        c = tf1.get_variable("c", initializer=tf.constant([1.0]))
      grad_c = tf1.placeholder(tf.float32, [1])
      result = guard.guarded_apply(
          [(tf.constant([1.0]), a), (None, b), (grad_c, c)],
          tf1.train.GradientDescentOptimizer(0.1).apply_gradients)
      self.assertEqual(["net/a", "net/c"], result.variable_names)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        flags = sess.run(result.nonfinite_flags, {grad_c: [_NAN]})
        self.assertTrue(np.array_equal([False, True], flags))
        bad = [n for n, f in zip(result.variable_names, flags) if f]
        self.assertEqual(["net/c"], bad)
        self.assertTrue(np.array_equal(
            [1.0], sess.run(b)))  # b had no gradient and is never touched


if __name__ == "__main__":
  tf.test.main()
