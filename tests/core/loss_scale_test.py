"""Tests for the dynamic loss scale that shares the guard's decision."""

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import guard
from tf1_safe_train.core import loss_scale as loss_scale_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import spikes

tf1 = tf.compat.v1


def _build(growth_steps=3, initial_scale=8.0, dtype=tf.float16,
           hysteresis=1):
  """A model of one variable computing in `dtype`; `x` feeds the input."""
  x = tf1.placeholder(dtype, [3])
  w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0, 3.0]))
  scale = loss_scale_lib.DynamicLossScale(
      initial_scale=initial_scale, growth_steps=growth_steps,
      hysteresis=hysteresis)
  loss = tf.reduce_sum(tf.cast(w, dtype) * x)
  opt = tf1.train.MomentumOptimizer(0.1, momentum=0.9)
  scale_value = scale.scale()
  grads = opt.compute_gradients(loss * tf.cast(scale_value, dtype),
                               var_list=[w])
  result = guard.guarded_apply(
      scale.unscale(grads, scale_value), opt.apply_gradients,
      branch_ops=[scale])
  return x, w, opt, scale, result


class DynamicLossScaleTest(tf.test.TestCase):

  def testHalvesOnOverflowAndKeepsEverythingElse(self):
    with tf.Graph().as_default():
      x, w, opt, scale, result = _build()
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(result.train_op, {x: [1.0, 1.0, 1.0]})
        momentum = opt.get_slot(w, "momentum")
        before = sess.run([w, momentum])
        # 60000 * scale 8 overflows float16 (max 65504): an Inf gradient.
        applied = sess.run(result.applied, {x: [60000.0, 1.0, 1.0]})
        self.assertFalse(applied)
        after = sess.run([w, momentum])
        for b, a in zip(before, after):
          self.assertTrue(np.array_equal(b, a))
        self.assertEqual(sess.run(scale.variables.scale), 4.0)
        self.assertEqual(sess.run(scale.variables.good_steps), 0)
        # At scale 4 the same input fits in float16: the step applies.
        self.assertTrue(sess.run(result.applied, {x: [60000.0 / 8, 1.0, 1.0]}))

  def testGrowsAfterGoodSteps(self):
    with tf.Graph().as_default():
      x, _, _, scale, result = _build(growth_steps=3, initial_scale=8.0)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        scales = []
        for _ in range(7):
          sess.run(result.train_op, {x: [1.0, 1.0, 1.0]})
          scales.append(sess.run(scale.variables.scale))
        self.assertEqual(scales, [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0])

  def testFloorAndFloorSkips(self):
    with tf.Graph().as_default():
      x, _, _, scale, result = _build(initial_scale=2.0)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        bad = {x: [np.nan, 1.0, 1.0]}
        values = []
        for _ in range(4):
          sess.run(result.train_op, bad)
          values.append(tuple(sess.run([scale.variables.scale,
                                        scale.variables.floor_skips])))
        # 2 -> 1 (an overflow-like skip), then skips at the floor: faults.
        self.assertEqual(values, [(1.0, 0), (1.0, 1), (1.0, 2), (1.0, 3)])
        sess.run(result.train_op, {x: [1.0, 1.0, 1.0]})
        self.assertEqual(sess.run(scale.variables.floor_skips), 0)

  def testScaleSurvivesCheckpoint(self):
    path = self.get_temp_dir() + "/ckpt"
    with tf.Graph().as_default():
      x, _, _, scale, result = _build(initial_scale=64.0)
      saver = tf1.train.Saver()
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(result.train_op, {x: [np.inf, 1.0, 1.0]})
        sess.run(result.train_op, {x: [1.0, 1.0, 1.0]})
        saver.save(sess, path)
    with tf.Graph().as_default():
      _, _, _, scale, _ = _build(initial_scale=64.0)
      saver = tf1.train.Saver()
      with tf1.Session() as sess:
        saver.restore(sess, path)
        self.assertEqual(sess.run(scale.variables.scale), 32.0)
        self.assertEqual(sess.run(scale.variables.good_steps), 1)

  def testNeverGrowsToInfinity(self):
    # Growing 2**127 would give Inf: every later step would be non-finite and
    # halving Inf gives Inf, so the run would skip forever.
    with tf.Graph().as_default():
      # float32: a scale this large is Inf in float16 already.
      x, _, _, scale, result = _build(growth_steps=1, initial_scale=2.0**126,
                                      dtype=tf.float32)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        scales = []
        for _ in range(3):
          sess.run(result.train_op, {x: [0.0, 0.0, 0.0]})
          scales.append(float(sess.run(scale.variables.scale)))
        self.assertEqual(scales, [2.0**127] * 3)
        self.assertEqual(sess.run(scale.variables.good_steps), 0)

  def testGrowthIsCappedAtTheDocumentedMaximum(self):
    # 3 * 2**125 is not a power of two: doubled it is 1.5 * 2**127, finite
    # in float32 but above the documented cap.
    with tf.Graph().as_default():
      x, _, _, scale, result = _build(growth_steps=1,
                                      initial_scale=3.0 * 2.0**125,
                                      dtype=tf.float32)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(result.train_op, {x: [0.0, 0.0, 0.0]})
        self.assertEqual(float(sess.run(scale.variables.scale)),
                         loss_scale_lib.MAX_SCALE)

  def testUnscaleIsExactAtTheLargestScales(self):
    # 1 / 2**127 is a float32 subnormal, which TensorFlow flushes to zero:
    # multiplying by it would turn every gradient into 0.
    for top in (2.0**127, 2.0**126 * 1.5):
      with tf.Graph().as_default():
        x, w, _, scale, result = _build(initial_scale=top, dtype=tf.float32)
        grads = scale.unscale([(tf.constant([2.0**-100, 2.0**-110]) *
                                scale.scale(), w)])
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          self.assertAllEqual(sess.run(grads[0][0]), [2.0**-100, 2.0**-110])
          before = sess.run(w)
          self.assertTrue(sess.run(result.applied, {x: [2.0**-100, 1.0, 1.0]}))
          self.assertFalse(np.array_equal(before, sess.run(w)))

  def testAnInfiniteScaleFromAnOldCheckpointRecovers(self):
    with tf.Graph().as_default():
      x, _, _, scale, result = _build(initial_scale=8.0, dtype=tf.float32)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(scale.variables.scale.assign(float("inf")))
        sess.run(result.train_op, {x: [1.0, 1.0, 1.0]})
        self.assertEqual(sess.run(scale.variables.scale),
                         loss_scale_lib.MAX_SCALE)

  def testRejectsBadSettings(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, "floor"):
        loss_scale_lib.DynamicLossScale(initial_scale=0.5, floor=1.0)
      for too_large in (float("inf"), 1e39, 2.0**128):
        with self.assertRaisesRegex(ValueError, "2\\*\\*127"):
          loss_scale_lib.DynamicLossScale(initial_scale=too_large)
      loss_scale_lib.DynamicLossScale(initial_scale=2.0**127, name="top")
      with self.assertRaisesRegex(ValueError, "growth_steps"):
        loss_scale_lib.DynamicLossScale(growth_steps=0)
      for bad in (0, -1, 1.5):
        with self.assertRaisesRegex(ValueError, "hysteresis"):
          loss_scale_lib.DynamicLossScale(hysteresis=bad)


# Overflows float16 at scale 8 (60000 * 8 > 65504), and at 4 and 2 too.
_OVERFLOW = [60000.0, 1.0, 1.0]
_GOOD = [1.0, 1.0, 1.0]


class HysteresisTest(tf.test.TestCase):
  """`DynamicLossScale(hysteresis=N)`: the N-th overflow in a row halves."""

  def _scales(self, inputs, hysteresis, initial_scale=8.0):
    """(applied, scale, overflow streak) after each step of `inputs`."""
    with tf.Graph().as_default():
      x, _, _, scale, result = _build(initial_scale=initial_scale,
                                      hysteresis=hysteresis, growth_steps=100)
      streak = scale.overflow_streak
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        out = []
        for values in inputs:
          applied = sess.run(result.applied, {x: values})
          out.append((bool(applied), float(sess.run(scale.variables.scale)),
                      None if streak is None else int(sess.run(streak))))
        return out

  def testOneOverflowKeepsTheScaleAndTwoInARowHalveIt(self):
    self.assertEqual(
        self._scales([_OVERFLOW, _OVERFLOW, _OVERFLOW], hysteresis=2),
        # Each overflow is skipped; the 2nd in a row halves the scale, and
        # so does each later one of the streak.
        [(False, 8.0, 1), (False, 4.0, 2), (False, 2.0, 2)])

  def testAnAppliedStepEndsTheStreak(self):
    self.assertEqual(
        self._scales([_OVERFLOW, _GOOD, _OVERFLOW, _GOOD], hysteresis=2),
        [(False, 8.0, 1), (True, 8.0, 0), (False, 8.0, 1), (True, 8.0, 0)])

  def testHysteresisOneHalvesOnEveryOverflowWithoutAStreakVariable(self):
    self.assertEqual(
        self._scales([_OVERFLOW, _GOOD, _OVERFLOW], hysteresis=1),
        [(False, 4.0, None), (True, 4.0, None), (False, 2.0, None)])
    with tf.Graph().as_default():
      scale = loss_scale_lib.DynamicLossScale()
      self.assertIsNone(scale.overflow_streak)
      self.assertEqual(list(scale.variables), scale.all_variables)
      self.assertLen(tf1.global_variables(), 3)

  def testAHeldOverflowIsStillASkip(self):
    with tf.Graph().as_default():
      x, _, _, _, result = _build(hysteresis=3)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(result.train_op, {x: _GOOD})
        names = [v.op.name for v in tf1.global_variables()]
        before = sess.run(tf1.global_variables())
        sess.run(result.train_op, {x: _OVERFLOW})
        after = sess.run(tf1.global_variables())
        moved = [n for n, b, a in zip(names, before, after)
                 if not np.array_equal(b, a)]
        self.assertCountEqual(moved, [
            "skipped_steps", "consecutive_skips", "loss_scale/good_steps",
            "loss_scale/overflow_streak"])

  def testTheStreakIsOptionalStateAndSurvivesACheckpoint(self):
    path = self.get_temp_dir() + "/ckpt"
    with tf.Graph().as_default():
      x, _, _, scale, result = _build(hysteresis=3)
      self.assertEqual(
          [scale.overflow_streak],
          tf1.get_collection(spikes.OPTIONAL_STATE))
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(result.train_op, {x: _OVERFLOW})
        sess.run(result.train_op, {x: _OVERFLOW})
        tf1.train.Saver().save(sess, path)
    with tf.Graph().as_default():
      _, _, _, scale, _ = _build(hysteresis=3)
      with tf1.Session() as sess:
        tf1.train.Saver().restore(sess, path)
        self.assertEqual(sess.run(scale.overflow_streak), 2)


class WrapperLossScaleTest(tf.test.TestCase):
  """`SkipNonFiniteOptimizer(opt, loss_scale=...)`, as legacy code uses it."""

  def testDynamicLossScaleInTheWrapper(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float16, [2])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 1.0]))
      loss = tf.reduce_sum(tf.cast(w, tf.float16) * x)
      scale = loss_scale_lib.DynamicLossScale(initial_scale=16.0,
                                              growth_steps=2)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.AdamOptimizer(0.1), loss_scale=scale)
      global_step = tf1.train.get_or_create_global_step()
      train_op = opt.minimize(loss, global_step=global_step)
      grads = opt.compute_gradients(loss, var_list=[w])
      self.assertEqual(grads[0][0].dtype, tf.float32)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        # Unscaled gradients: the same as an unscaled float32 loss.
        self.assertAllEqual(sess.run(grads[0][0], {x: [3.0, -2.0]}),
                            [3.0, -2.0])
        sess.run(train_op, {x: [1.0, 1.0]})
        before = sess.run(tf1.global_variables())
        # 5000 * 16 = 80000 overflows float16: skipped, scale halves.
        sess.run(train_op, {x: [5000.0, 1.0]})
        after = sess.run(tf1.global_variables())
        names = [v.op.name for v in tf1.global_variables()]
        moved = [n for n, b, a in zip(names, before, after)
                 if not np.array_equal(b, a)]
        self.assertCountEqual(moved, [
            "global_step", "skipped_steps", "consecutive_skips",
            "loss_scale/scale", "loss_scale/good_steps"])
        self.assertEqual(sess.run(scale.variables.scale), 8.0)
        # At scale 8 it fits; two applied steps in a row double the scale.
        sess.run(train_op, {x: [5000.0, 1.0]})
        sess.run(train_op, {x: [5000.0, 1.0]})
        self.assertEqual(sess.run(scale.variables.scale), 16.0)
        self.assertTrue(np.isfinite(sess.run(w)).all())

  def testFloat16VariablesKeepTheirGradientDtype(self):
    # A float32 gradient against a float16 variable aborts the process (a
    # CHECK failure in the update kernel), so the dtype is asserted first.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float16, [2])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 1.0],
                                                        tf.float16))
      table = tf1.get_variable("table", initializer=tf.ones([4, 2],
                                                            tf.float16))
      loss = tf.reduce_sum(w * x) + tf.reduce_sum(tf.gather(table, [1]) * x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.5),
          loss_scale=loss_scale_lib.DynamicLossScale(initial_scale=1024.0))
      grads = opt.compute_gradients(loss, var_list=[w, table])
      self.assertEqual([g.dtype for g, _ in grads], [tf.float16, tf.float16])
      train_op = opt.apply_gradients(grads)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: [2.0, -2.0]})
        self.assertAllEqual(sess.run(w), [0.0, 2.0])
        self.assertAllEqual(sess.run(table)[1], [0.0, 2.0])
        # 100 * 1024 overflows float16: skipped, nothing moves.
        sess.run(train_op, {x: [100.0, 1.0]})
        self.assertAllEqual(sess.run(w), [0.0, 2.0])
        self.assertEqual(sess.run(opt.loss_scale.variables.scale), 512.0)

  def testHysteresisInTheWrapper(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float16, [2])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 1.0]))
      loss = tf.reduce_sum(tf.cast(w, tf.float16) * x)
      scale = loss_scale_lib.DynamicLossScale(initial_scale=16.0,
                                              hysteresis=2)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), loss_scale=scale)
      train_op = opt.minimize(loss)
      # What Keras initializes: the streak too.
      self.assertIn(scale.overflow_streak, opt.variables())
      with self.cached_session() as sess:
        sess.run(tf1.variables_initializer(opt.variables() + [w]))
        scales = []
        for first in (5000.0, 1.0, 5000.0, 5000.0):  # 5000 * 16 overflows.
          sess.run(train_op, {x: [first, 1.0]})
          scales.append(float(sess.run(scale.variables.scale)))
        self.assertEqual(scales, [16.0, 16.0, 16.0, 8.0])

  def testStringDynamic(self):
    with tf.Graph().as_default():
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), loss_scale="dynamic")
      self.assertIsInstance(opt.loss_scale, loss_scale_lib.DynamicLossScale)
      with self.assertRaisesRegex(ValueError, "loss_scale"):
        optimizer_lib.SkipNonFiniteOptimizer(
            tf1.train.GradientDescentOptimizer(0.1), loss_scale="static")


if __name__ == "__main__":
  tf.test.main()
