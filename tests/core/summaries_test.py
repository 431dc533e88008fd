"""Gradient summaries that survive the steps the wrapper skips."""

import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tests.fixtures import train_dirs
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import summaries

tf1 = tf.compat.v1


class GradientSummariesTest(tf.test.TestCase):

  def _train(self, add_summaries, batches):
    """Runs `batches` with a summary written every step; returns counters."""
    train_dir = self.get_temp_dir()
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      grads_and_vars = opt.compute_gradients(loss)
      add_summaries(grads_and_vars)
      train_op = opt.apply_gradients(grads_and_vars, global_step)
      with tf1.train.MonitoredTrainingSession(
          checkpoint_dir=train_dir, save_summaries_steps=1,
          save_checkpoint_secs=None) as sess:
        for batch in batches:
          sess.run(train_op, {x: batch})
        counters = sess.run_step_fn(
            lambda step_context: step_context.session.run(
                counters_lib.skip_counters()))
    return train_dir, counters

  def testPlainHistogramOfANanGradientKillsTheRun(self):
    def add(grads_and_vars):
      for g, v in grads_and_vars:
        tf1.summary.histogram(v.op.name + "/gradients", g)

    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "Nan in summary histogram"):
      self._train(add, [test_util.GOOD_X, test_util.NAN_X])

  def testFiniteHistogramSurvivesAndCountsTheNonFinite(self):
    train_dir, counters = self._train(
        summaries.gradient_histograms,
        [test_util.GOOD_X, test_util.NAN_X, test_util.GOOD_X2])
    self.assertEqual((counters.applied_steps, counters.skipped_steps), (2, 1))
    counts = dict(train_dirs.scalars(train_dir,
                                         "model/w/gradients/nonfinite_count"))
    # Written after each step, at global_step 1..3; only w[1]'s gradient
    # meets the NaN of NAN_X.
    self.assertEqual(counts, {1: 0.0, 2: 1.0, 3: 0.0})

  def testIndexedSlicesAndAllNonFinite(self):
    with tf.Graph().as_default():
      values = tf.constant([[float("nan"), float("inf")]])
      slices = tf.IndexedSlices(values, tf.constant([0]))
      merged = summaries.histogram("g", slices)
      with self.session() as sess:
        summary = tf1.Summary.FromString(sess.run(merged))
    by_tag = {v.tag: v for v in summary.value}
    self.assertEqual(by_tag["g/nonfinite_count"].simple_value, 2.0)
    self.assertEqual(by_tag["g"].histo.num, 0.0)


if __name__ == "__main__":
  tf.test.main()
