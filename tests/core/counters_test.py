"""Tests for tf1_safe_train.core.counters."""

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import guard

tf1 = tf.compat.v1

_NAMES = ["applied_steps", "skipped_steps", "consecutive_skips"]


class SkipCountersTest(tf.test.TestCase):

  def testCreatedOncePerGraph(self):
    with tf.Graph().as_default() as graph_a:
      first = counters_lib.skip_counters()
      second = counters_lib.skip_counters()
    with tf.Graph().as_default() as graph_b:
      other = counters_lib.skip_counters()
    self.assertLen(first, 3)
    for a, b, c in zip(first, second, other):
      self.assertIs(a, b)
      self.assertIsNot(a, c)
    self.assertIs(graph_a, first.applied_steps.graph)
    self.assertIs(graph_b, other.applied_steps.graph)
    self.assertLen(graph_a.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES), 3)
    # The graph argument picks the graph, whatever the default.
    with tf.Graph().as_default():
      self.assertIs(first.skipped_steps,
                    counters_lib.skip_counters(graph_a).skipped_steps)

  def testNamesAreAtRootInsideScopes(self):
    with tf.Graph().as_default():
      pred = tf1.placeholder(tf.bool, [])
      created = []

      def _branch():
        created.append(counters_lib.skip_counters())
        created.append(counters_lib.skip_counters())
        return tf.constant(1)

      with tf1.variable_scope("model"), tf1.name_scope("tower_0"):
        with tf1.control_dependencies([tf.no_op(name="forward")]):
          tf.cond(pred, _branch, lambda: tf.constant(0))
      self.assertLen(created, 2)
      counters = created[0]
      self.assertEqual(counters, created[1])
      self.assertEqual(_NAMES, [c.op.name for c in counters])
      self.assertEqual(counters, counters_lib.skip_counters())
      for counter in counters:
        self.assertEqual(tf.int64, counter.dtype.base_dtype)
        self.assertEqual([], counter.shape.as_list())
        # Created outside the cond and the control dependencies.
        self.assertEmpty(counter.op.control_inputs)
        self.assertIsNone(counter.op._control_flow_context)  # pylint: disable=protected-access
      self.assertEmpty(tf1.trainable_variables())
      self.assertEqual(list(counters), tf1.global_variables())
      self.assertEqual(list(counters),
                       tf1.get_collection(counters_lib.COLLECTION))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        self.assertEqual([0, 0, 0], sess.run(list(counters)))

  def testNamesAreAtRootInsideVariableScopeAndControlDependencies(self):
    with tf.Graph().as_default():
      with tf1.variable_scope("outer"), tf1.variable_scope("inner"):
        x = tf.constant(1.0)
        with tf1.control_dependencies([x]):
          counters = counters_lib.skip_counters()
      self.assertEqual(_NAMES, [c.op.name for c in counters])
      for counter in counters:
        self.assertEmpty(counter.op.control_inputs)
        self.assertEmpty(counter.initializer.control_inputs)

  def testFollowsDeviceScope(self):
    with tf.Graph().as_default():
      with tf.device("/job:ps/task:0"):
        counters = counters_lib.skip_counters()
      for counter in counters:
        self.assertIn("/job:ps/task:0", counter.device)

  def testReadAfterOrdersReadsAfterTheOp(self):
    with tf.Graph().as_default():
      counters = counters_lib.skip_counters()
      bump = tf1.assign_add(counters.skipped_steps,
                            tf.constant(5, dtype=tf.int64))
      read = counters_lib.read_after(counters, bump)
      self.assertIsInstance(read, counters_lib.SkipCounters)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for expected in (5, 10):
          self.assertEqual(expected, sess.run(read).skipped_steps)

  def testSurviveSaverRestoreAndContinueCounting(self):
    path = self.get_temp_dir() + "/counters"
    good, bad = [0.5], [float("nan")]

    def _build():
      grad = tf1.placeholder(tf.float32, [1])
      w = tf1.get_variable("w", initializer=tf.constant([1.0]))
      result = guard.guarded_apply(
          [(grad, w)],
          tf1.train.GradientDescentOptimizer(0.1).apply_gradients)
      return grad, result

    with tf.Graph().as_default():
      grad, result = _build()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for value in (good, good, bad, good, bad, bad):
          sess.run(result.train_op, {grad: value})
        self.assertEqual(
            [3, 3, 2], sess.run(list(counters_lib.skip_counters())))
        tf1.train.Saver().save(sess, path)

    with tf.Graph().as_default():
      grad, result = _build()
      counters = counters_lib.skip_counters()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        self.assertEqual([0, 0, 0], sess.run(list(counters)))
        tf1.train.Saver().restore(sess, path)
        self.assertEqual([3, 3, 2], sess.run(list(counters)))
        _, after_bad = sess.run([result.train_op, result.counters],
                                {grad: bad})
        self.assertEqual((3, 4, 3), tuple(after_bad))
        _, after_good = sess.run([result.train_op, result.counters],
                                 {grad: good})
        self.assertEqual((4, 4, 0), tuple(after_good))


if __name__ == "__main__":
  tf.test.main()
