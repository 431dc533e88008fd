"""Tests for tf1_safe_train.trainer.step.optimization.

Schedules and overflow-safe clipping.
"""

import numpy as np
import tensorflow as tf

from tf1_safe_train.trainer.step import optimization

tf1 = tf.compat.v1

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _run(fetches, feed=None):
  with tf1.Session() as sess:
    return sess.run(fetches, feed)


class GlobalNormTest(tf.test.TestCase):

  def testMatchesTheL2NormOfOrdinaryValues(self):
    with tf.Graph().as_default():
      values = [np.array([3.0, -4.0], np.float32),
                np.array([[12.0]], np.float32)]
      norm = _run(optimization.global_norm(
          [tf.constant(v) for v in values] + [None]))
      self.assertAllClose(13.0, norm)

  def testDoesNotOverflowWhereTheSumOfSquaresWould(self):
    with tf.Graph().as_default():
      big = tf.constant([1e20, -1e20], tf.float32)
      self.assertEqual(np.inf, _run(tf.linalg.global_norm([big])))
      self.assertAllClose(np.sqrt(2.0) * 1e20,
                          _run(optimization.global_norm([big])), rtol=1e-6)

  def testZeroGradients(self):
    with tf.Graph().as_default():
      self.assertEqual(0.0, _run(optimization.global_norm([tf.zeros([3])])))


class ClipByGlobalNormTest(tf.test.TestCase):

  def _clip(self, values, clip_norm):
    variables = [tf1.get_variable("v%d" % i, initializer=tf.zeros_like(v))
                 for i, v in enumerate(values)]
    clipped, norm = optimization.clip_by_global_norm(
        [(tf.constant(v), var) for v, var in zip(values, variables)],
        clip_norm)
    for (_, var_out), var in zip(clipped, variables):
      self.assertIs(var, var_out)
    return _run(([g for g, _ in clipped], norm))

  def testWithinTheNormPassesThroughBitForBit(self):
    with tf.Graph().as_default():
      values = [np.array([0.1, -0.2, 0.3], np.float32),
                np.array([1e-30], np.float32)]
      clipped, _ = self._clip(values, 1.0)
      for got, want in zip(clipped, values):
        self.assertEqual(want.tobytes(), got.tobytes())

  def testAgreesWithTensorFlowOnOrdinaryValues(self):
    with tf.Graph().as_default():
      rng = np.random.default_rng(0)
      values = [rng.normal(size=[4, 5]).astype(np.float32),
                rng.normal(size=[7]).astype(np.float32)]
      clipped, norm = self._clip(values, 0.5)
      want, want_norm = _run(tf.clip_by_global_norm(
          [tf.constant(v) for v in values], 0.5))
      self.assertAllClose(want_norm, norm, rtol=1e-6)
      for got, expected in zip(clipped, want):
        self.assertAllClose(expected, got, rtol=1e-5, atol=1e-7)

  def testFiniteGradientsBeyondTheFloat32MaximumAreClippedNotZeroed(self):
    # Their norm (about 4.2e38) is beyond float32: a factor clip / norm would
    # be 0 and turn the applied step into a zero-gradient step, which still
    # moves momentum and Adam.
    with tf.Graph().as_default():
      values = [np.array([3e38, -3e38], np.float32),
                np.array([1.0], np.float32)]
      clipped, norm = self._clip(values, 2.0)
      self.assertEqual(np.inf, norm)
      flat = np.concatenate(clipped)
      self.assertTrue(np.isfinite(flat).all())
      self.assertAllClose(2.0, np.linalg.norm(flat.astype(np.float64)),
                          rtol=1e-6)
      self.assertAllClose([np.sqrt(2.0), -np.sqrt(2.0)], clipped[0],
                          rtol=1e-6)
      # The small gradient's exact value, 4.7e-39, is below float32's normal
      # range, which TensorFlow flushes to zero: lost either way.
      self.assertGreaterEqual(clipped[1][0], 0.0)

  def testIndexedSlicesAreClippedLikeDenseGradients(self):
    with tf.Graph().as_default():
      table = tf1.get_variable("table", initializer=tf.zeros([4, 2]))
      dense = tf1.get_variable("dense", initializer=tf.zeros([2]))
      slices = tf.IndexedSlices(tf.constant([[3.0, 0.0]]), tf.constant([1]),
                                tf.constant([4, 2]))
      clipped, norm = optimization.clip_by_global_norm(
          [(slices, table), (tf.constant([0.0, 4.0]), dense), (None, dense)],
          1.0)
      self.assertIsInstance(clipped[0][0], tf.IndexedSlices)
      self.assertIsNone(clipped[2][0])
      values, dense_grad, norm = _run(
          (clipped[0][0].values, clipped[1][0], norm))
      self.assertAllClose(5.0, norm)
      self.assertAllClose([[0.6, 0.0]], values)
      self.assertAllClose([0.0, 0.8], dense_grad)


class LearningRateTest(tf.test.TestCase):

  def testSchedulesFollowTheGivenStep(self):
    with tf.Graph().as_default():
      step = tf1.placeholder(tf.int64, [])
      rates = {name: optimization.learning_rate(name, 0.1, step, 100)
               for name in ("constant", "piecewise", "cosine")}
      with tf1.Session() as sess:
        at = lambda name, s: sess.run(rates[name], {step: s})
        self.assertAllClose(0.1, at("constant", 0))
        self.assertAllClose(0.1, at("constant", 99))
        self.assertAllClose(0.1, at("piecewise", 50))
        self.assertAllClose(0.01, at("piecewise", 51))
        self.assertAllClose(0.001, at("piecewise", 76))
        self.assertAllClose(0.1, at("cosine", 0))
        self.assertAllClose(0.05, at("cosine", 50))
        self.assertAllClose(0.0, at("cosine", 100), atol=1e-9)
        self.assertAllClose(0.0, at("cosine", 150), atol=1e-9)

  def testRejectsAnUnknownSchedule(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, "schedule 'linear'"):
        optimization.learning_rate("linear", 0.1, tf.constant(0), 10)


if __name__ == "__main__":
  tf.test.main()
