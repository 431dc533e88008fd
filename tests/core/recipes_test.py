"""Why the popular "skip NaN steps" recipes fail, and that the wrapper doesn't.

Each test asserts the failure of one recipe and, where it applies, that
`SkipNonFiniteOptimizer` handles the same case.
"""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import optimizer as optimizer_lib

tf1 = tf.compat.v1

_NAN = float("nan")


def _values(sess, variables):
  return dict(zip([v.op.name for v in variables], sess.run(variables)))


def _assert_bit_identical(test, expected, actual):
  test.assertEqual(sorted(expected), sorted(actual))
  test.assertNotEmpty(expected)
  for name in expected:
    test.assertTrue(np.array_equal(expected[name], actual[name]),
                    "%s: %r != %r" % (name, expected[name], actual[name]))


class CheckNumericsAtGraphBuildTest(tf.test.TestCase):
  """Recipe 1: `try: tf.debugging.check_numerics(t) except: skip`."""

  def _reports_finite(self, tensor):
    # The recipe, verbatim: in graph mode this only builds an op.
    try:
      checked = tf.debugging.check_numerics(tensor, "gradient")
    except (tf.errors.InvalidArgumentError, ValueError):
      return False, None
    return True, checked

  def testReportsFiniteForNanPlaceholderAndFailsOnlyAtRun(self):
    with tf.Graph().as_default():
      grad = tf1.placeholder(tf.float32, [2])
      reported_finite, checked = self._reports_finite(grad)
      self.assertTrue(reported_finite)
      with tf1.Session() as sess:
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "gradient"):
          sess.run(checked, {grad: [_NAN, 1.0]})
        # The guard's check is a value, computed when the step runs.
        self.assertTrue(sess.run(nonfinite.is_nonfinite(grad),
                                 {grad: [_NAN, 1.0]}))

  def testReportsFiniteForNanValuedTensor(self):
    with tf.Graph().as_default():
      grad = tf.constant([_NAN, 1.0]) * 2.0
      reported_finite, checked = self._reports_finite(grad)
      self.assertTrue(reported_finite)
      with tf1.Session() as sess:
        with self.assertRaises(tf.errors.InvalidArgumentError):
          sess.run(checked)
        self.assertTrue(sess.run(nonfinite.is_nonfinite(grad)))


class CheckNumericsPerGradientTest(tf.test.TestCase):
  """Recipe 2: `check_numerics` on each gradient as a control dep of apply.

  Each apply waits only for its own gradient's check, so nothing stops the
  first variable's update when the second gradient is NaN. Unordered, whether
  it runs before the failing check aborts the step is a race; here the
  updates are chained (as a loop that serializes them would) so the outcome
  is deterministic.
  """

  def _build(self):
    v1 = tf1.get_variable("v1", initializer=tf.constant([1.0, 2.0]))
    v2 = tf1.get_variable("v2", initializer=tf.constant([3.0, 4.0]))
    g1 = tf1.placeholder(tf.float32, [2], name="g1")
    g2 = tf1.placeholder(tf.float32, [2], name="g2")
    return [(g1, v1), (g2, v2)]

  def testFailingStepStillUpdatesFirstVariable(self):
    with tf.Graph().as_default():
      (g1, v1), (g2, v2) = grads_and_vars = self._build()
      opt = tf1.train.GradientDescentOptimizer(0.5)
      updates = []
      for grad, var in grads_and_vars:
        with tf1.control_dependencies(updates[-1:]):
          with tf1.control_dependencies(
              [tf.debugging.check_numerics(grad, var.op.name)]):
            updates.append(opt.apply_gradients([(grad, var)]))
      train_op = tf.group(*updates)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "v2"):
          sess.run(train_op, {g1: [1.0, 1.0], g2: [_NAN, 1.0]})
        # The step "failed", yet v1 moved: the update was not atomic.
        self.assertAllEqual([0.5, 1.5], sess.run(v1))
        self.assertAllEqual([3.0, 4.0], sess.run(v2))

  def testWrapperUpdatesNeitherVariable(self):
    with tf.Graph().as_default():
      (g1, v1), (g2, v2) = grads_and_vars = self._build()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.5))
      train_op = opt.apply_gradients(grads_and_vars)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        _, applied = sess.run([train_op, opt.applied()],
                              {g1: [1.0, 1.0], g2: [_NAN, 1.0]})
        self.assertFalse(applied)
        self.assertTrue(np.array_equal([1.0, 2.0], sess.run(v1)))
        self.assertTrue(np.array_equal([3.0, 4.0], sess.run(v2)))


def _zero_if_nonfinite(grads_and_vars):
  """Recipe 3: replace every gradient by zeros if any is non-finite."""
  all_finite = tf.reduce_all(
      [tf.reduce_all(tf.math.is_finite(g)) for g, _ in grads_and_vars])
  return [(tf.where(all_finite, g, tf.zeros_like(g)), v)
          for g, v in grads_and_vars]


class ZeroGradientsTest(tf.test.TestCase, parameterized.TestCase):
  """Recipe 3: zeroing the gradients is not a skip."""

  def _run(self, make, wrap):
    """One good step, then a NaN step; returns the state around the NaN."""
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=tf.constant([1.0, -2.0]))
      grad = tf1.placeholder(tf.float32, [2])
      opt = make()
      if wrap:
        opt = optimizer_lib.SkipNonFiniteOptimizer(opt)
        train_op = opt.apply_gradients([(grad, w)])
      else:
        train_op = opt.apply_gradients(_zero_if_nonfinite([(grad, w)]))
      skip = set(counters_lib.skip_counters()) if wrap else set()
      state = [v for v in tf1.global_variables() if v not in skip]
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {grad: [0.5, 0.25]})
        before = _values(sess, state)
        sess.run(train_op, {grad: [_NAN, 0.25]})
        after = _values(sess, state)
    return before, after

  def testZeroGradientsMoveMomentumWeights(self):
    before, after = self._run(lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
                              wrap=False)
    self.assertFalse(np.array_equal([0.0, 0.0], before["w/Momentum"]))
    # w -= lr * (0.9 * accum + 0): the weights keep moving.
    self.assertAllClose(before["w"] - 0.1 * 0.9 * before["w/Momentum"],
                        after["w"])
    self.assertFalse(np.array_equal(before["w"], after["w"]))
    self.assertFalse(np.array_equal(before["w/Momentum"], after["w/Momentum"]))

  def testZeroGradientsMoveAdamWeightsAndBetaPowers(self):
    before, after = self._run(lambda: tf1.train.AdamOptimizer(0.1),
                              wrap=False)
    # beta powers start at beta and are multiplied by it after every step.
    self.assertAllClose(0.9 ** 2, before["beta1_power"])
    self.assertAllClose(0.9 ** 3, after["beta1_power"])
    self.assertAllClose(0.999 ** 3, after["beta2_power"])
    self.assertFalse(np.array_equal(before["w"], after["w"]))
    self.assertFalse(np.array_equal(before["w/Adam"], after["w/Adam"]))

  @parameterized.named_parameters(
      ("Momentum", lambda: tf1.train.MomentumOptimizer(0.1, 0.9)),
      ("Adam", lambda: tf1.train.AdamOptimizer(0.1)))
  def testWrapperLeavesEverythingBitIdentical(self, make):
    before, after = self._run(make, wrap=True)
    self.assertIn("w", before)
    self.assertGreater(len(before), 1)  # slots (and beta powers) included
    _assert_bit_identical(self, before, after)


def _bn_net(images):
  """A tiny legacy net: conv, fused batch norm with UPDATE_OPS, dense."""
  rng = np.random.RandomState(0)
  kernel = tf1.get_variable(
      "kernel", initializer=rng.randn(2, 2, 1, 2).astype(np.float32))
  gamma = tf1.get_variable("gamma", initializer=tf.ones([2]))
  beta = tf1.get_variable("beta", initializer=tf.zeros([2]))
  moving_mean = tf1.get_variable("moving_mean", initializer=tf.zeros([2]),
                                 trainable=False)
  moving_variance = tf1.get_variable("moving_variance", initializer=tf.ones([2]),
                                     trainable=False)
  conv = tf.nn.conv2d(images, kernel, strides=1, padding="SAME")
  normed, mean, variance = tf1.nn.fused_batch_norm(conv, gamma, beta,
                                                   is_training=True)
  for var, value in ((moving_mean, mean), (moving_variance, variance)):
    tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                          tf1.assign_sub(var, (var - value) * (1 - 0.9)))
  loss = tf.reduce_sum(tf.square(tf.nn.relu(normed) - 0.5))
  return loss, [kernel, gamma, beta], [moving_mean, moving_variance]


def _images(nan=False):
  images = np.random.RandomState(1).rand(2, 3, 3, 1).astype(np.float32)
  if nan:
    images[1, 2, 0, 0] = _NAN
  return images


class LossScaleOptimizerTest(tf.test.TestCase):
  """Recipes 4 and 5: TF's MixedPrecisionLossScaleOptimizer."""

  def testFixedLossScaleAppliesNanUpdate(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [2])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
      loss = tf.reduce_sum(w * x)
      opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
          tf1.train.MomentumOptimizer(0.1, 0.9), loss_scale=128)
      train_op = opt.minimize(loss)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: [1.0, 2.0]})
        self.assertTrue(np.isfinite(sess.run(w)).all())
        sess.run(train_op, {x: [_NAN, 2.0]})
        self.assertTrue(np.isnan(sess.run(w)).any())

  def testWrapperDoesNotApplyNanUpdate(self):
    # Alone, and around the same fixed-scale loss-scale optimizer.
    for fixed_loss_scale in (None, 128):
      with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [2])
        w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
        loss = tf.reduce_sum(w * x)
        inner = tf1.train.MomentumOptimizer(0.1, 0.9)
        if fixed_loss_scale:
          inner = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
              inner, loss_scale=fixed_loss_scale)
        opt = optimizer_lib.SkipNonFiniteOptimizer(inner)
        train_op = opt.minimize(loss)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          sess.run(train_op, {x: [1.0, 2.0]})
          before = _values(sess, tf1.trainable_variables())
          self.assertAllClose([0.9, 1.8], before["w"])
          sess.run(train_op, {x: [_NAN, 2.0]})
          _assert_bit_identical(self, before,
                                _values(sess, tf1.trainable_variables()))

  def testDynamicLossScaleLetsMovingStatisticsGoNan(self):
    with tf.Graph().as_default():
      images = tf1.placeholder(tf.float32, [2, 3, 3, 1])
      loss, weights, moving = _bn_net(images)
      opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
          tf1.train.MomentumOptimizer(0.1, 0.9), loss_scale="dynamic")
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.minimize(loss)
      scale = [v for v in tf1.global_variables()
               if v.op.name == "current_loss_scale"]
      self.assertLen(scale, 1)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {images: _images()})
        weights_before = _values(sess, weights)
        scale_before = sess.run(scale[0])
        sess.run(train_op, {images: _images(nan=True)})
        # It did skip the weights and halve its scale...
        _assert_bit_identical(self, weights_before, _values(sess, weights))
        self.assertEqual(scale_before / 2, sess.run(scale[0]))
        # ...but the UPDATE_OPS ran outside its cond: the statistics are NaN.
        for value in sess.run(moving):
          self.assertTrue(np.isnan(value).all())

  def testWrapperKeepsMovingStatisticsFinite(self):
    with tf.Graph().as_default():
      images = tf1.placeholder(tf.float32, [2, 3, 3, 1])
      loss, weights, moving = _bn_net(images)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.MomentumOptimizer(0.1, 0.9))
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.minimize(loss)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {images: _images()})
        before = _values(sess, weights + moving)
        sess.run(train_op, {images: _images(nan=True)})
        after = _values(sess, weights + moving)
      for var in moving:
        self.assertTrue(np.isfinite(after[var.op.name]).all())
      _assert_bit_identical(self, before, after)

  def testWrappingDynamicLossScaleOptimizerHalvesItsScaleOnASkip(self):
    """The wrapper outside a dynamic loss-scale optimizer (the advised order).

    Its scale update lives inside its apply_gradients, which the wrapper
    only runs on finite steps; the wrapper's skip branch halves the scale
    itself (`loss_scale_stacking.branch_ops`), so an overflow can recover.
    (Before, the scale froze and an overflow was skipped again and again.)
    """
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [2])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
              tf1.train.MomentumOptimizer(0.1, 0.9), loss_scale="dynamic"))
      train_op = opt.minimize(tf.reduce_sum(w * x))
      scale = [v for v in tf1.global_variables()
               if v.op.name == "current_loss_scale"]
      self.assertLen(scale, 1)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial_scale = sess.run(scale[0])
        scales = []
        for _ in range(3):
          _, applied = sess.run([train_op, opt.applied()], {x: [_NAN, 1.0]})
          self.assertFalse(applied)
          scales.append(sess.run(scale[0]))
        self.assertEqual(
            [initial_scale / 2, initial_scale / 4, initial_scale / 8], scales)


if __name__ == "__main__":
  tf.test.main()
