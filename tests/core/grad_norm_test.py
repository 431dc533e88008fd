"""--skip_grad_norm_above (wrapper: skip_grad_norm_above=): a finite step
whose global gradient norm (the context's overflow-safe one) exceeds X is
skipped, labelled "grad_norm" and counted."""

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import norms
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.trainer.config import params as params_lib

tf1 = tf.compat.v1


class GradNormTest(tf.test.TestCase):

  def testWrapperSkipsAboveTheCeiling(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0, 3.0]))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), skip_grad_norm_above=10.0)
      train_op = opt.minimize(tf.reduce_sum(x * w))
      counts = opt.guard_result().reasons.counts
      hook = opt.report_hook()
      with tf1.train.SingularMonitoredSession(hooks=[hook]) as sess:
        sess.run(train_op, {x: np.full(3, 1.0, np.float32)})  # Norm 1.7.
        before = sess.run(w)
        # The gradient is x: norm 3e20, whose square overflows float32.
        _, after = sess.run([train_op, counts],
                            {x: np.full(3, 1e20 / np.sqrt(3), np.float32)})
        self.assertAllEqual(before, sess.run(w))
        self.assertEqual(after, {"nonfinite_skips": 0, "grad_norm_skips": 1})
    self.assertRegex(hook.reports[0], r"^skipped step 1: grad_norm, gradient "
                     r"norm 1e\+20 > threshold 10$")

  def testBadValuesAreRefused(self):
    with self.assertRaisesRegex(params_lib.ParamsError,
                                r"--skip_grad_norm_above=-1\.0: must be a "
                                r"finite number >= 0"):
      params_lib.TrainParams(skip_grad_norm_above=-1.0).validate()
    with self.assertRaisesRegex(ValueError, "skip_grad_norm_above=0"):
      optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), skip_grad_norm_above=0)
    with self.assertRaisesRegex(TypeError, "skip_grad_norm_abov\\b"):
      optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), skip_grad_norm_abov=1.0)


class NormsTest(tf.test.TestCase):

  def testGlobalNormDoesNotOverflowForFiniteValues(self):
    with tf.Graph().as_default(), self.session() as sess:
      big = tf.constant([3e38, 3e38], tf.float32)
      small = tf.constant([3.0, 4.0], tf.float32)
      sparse = tf.IndexedSlices(tf.constant([[12.0]]), tf.constant([0]))
      values = sess.run([norms.global_norm([big, None]),
                         norms.global_norm([small, sparse])])
    self.assertAllClose(values, [np.inf, 13.0])  # sqrt(2) * 3e38 > max.
    with tf.Graph().as_default(), self.session() as sess:
      self.assertAllClose(
          sess.run(norms.global_norm([tf.constant([1e20, 1e20])])),
          np.sqrt(2) * 1e20, rtol=1e-6)


if __name__ == "__main__":
  tf.test.main()
