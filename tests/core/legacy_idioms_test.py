"""Legacy batch-norm and multi-tower idioms, as users write them, wrapped.

`tf.compat.v1.layers.batch_normalization` with `training` as a Python bool,
a placeholder or a `placeholder_with_default` (fused and not: a tensor
`training` puts the non-fused moving averages inside a cond), hand-written
moving averages over `tf.compat.v1.nn.fused_batch_norm`, under both cond
implementations and ref variables; a replicated benchmark that groups only
tower 0's update ops into its train op; tf-slim's update-op barrier.
"""

import os

# Before TensorFlow loads: tf.compat.v1.layers need Keras 2 (tf-keras,
# requirements-legacy.txt), which TF 2.16+ only uses if this is set.
os.environ["TF_USE_LEGACY_KERAS"] = "1"

from absl.testing import parameterized  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

from tests.fixtures import tiny_model as test_util  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf1_safe_train.core import counters as counters_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf1_safe_train.core import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1

# name -> (control flow v2, resource variables), for test_util.tf_config.
_CONFIGS = {"CondV2": (True, True), "CondV1": (False, True),
            "CondV1RefVariables": (False, False)}
# name -> (input rank, `fused` argument of batch_normalization).
_LAYERS = {"NonFused2D": (2, None), "NotFused4D": (4, False),
           "Fused4D": (4, True)}


def _training(kind):
  """(`training` argument, feed dict entries) for a kind of `training`."""
  if kind == "PythonBool":
    return True, {}
  if kind == "Placeholder":
    training = tf1.placeholder(tf.bool, [], name="is_training")
    return training, {training: True}
  return tf1.placeholder_with_default(True, [], name="is_training"), {}


def _batch(rank, seed, nan=False):
  shape = [4, 3] if rank == 2 else [4, 2, 2, 3]
  batch = np.random.RandomState(seed).rand(*shape).astype(np.float32)
  if nan:
    batch.flat[5] = np.nan
  return batch


def _moving_statistics():
  return [v for v in tf1.global_variables()
          if "moving_" in v.op.name and "skip_shadow" not in v.op.name]


def _names(variables):
  return sorted(v.op.name for v in variables)


def _assert_skip_rolls_back(test, sess, train_op, feed, moving):
  """A good step moves `moving`, a NaN one leaves it, a good one moves it."""
  initial = sess.run(moving)
  sess.run(train_op, feed(1))
  before = sess.run(moving)
  for first, value in zip(initial, before):
    test.assertFalse(np.array_equal(first, value))
  sess.run(train_op, feed(2, nan=True))
  after_nan = sess.run(moving)
  for value, kept in zip(before, after_nan):
    test.assertTrue(np.isfinite(kept).all(), kept)
    test.assertTrue(np.array_equal(value, kept), (value, kept))
  test.assertEqual([1, 1, 1], sess.run(list(counters_lib.skip_counters())))
  sess.run(train_op, feed(3))
  for value, moved in zip(after_nan, sess.run(moving)):
    test.assertTrue(np.isfinite(moved).all(), moved)
    test.assertFalse(np.array_equal(value, moved))


class BatchNormIdiomsTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      (layer + training_kind + config, layer, training_kind, config)
      for layer in sorted(_LAYERS)
      for training_kind in ("PythonBool", "Placeholder",
                            "PlaceholderWithDefault")
      for config in sorted(_CONFIGS))
  def testLayersBatchNormStatisticsAreRolledBack(self, layer, training_kind,
                                                 config):
    rank, fused = _LAYERS[layer]
    with test_util.tf_config(*_CONFIGS[config]), tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3] if rank == 2 else [4, 2, 2, 3])
      training, training_feed = _training(training_kind)
      y = tf1.layers.batch_normalization(x, training=training, fused=fused)
      loss = tf.reduce_mean(tf.square(y - 1.0))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.MomentumOptimizer(0.1, 0.9))
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.minimize(loss)
      moving = _moving_statistics()
      self.assertEqual(["batch_normalization/moving_mean",
                        "batch_normalization/moving_variance"],
                       _names(moving))
      self.assertEqual(_CONFIGS[config][1], hasattr(moving[0], "handle"))
      self.assertEqual(_names(moving),
                       sorted(opt.guard_result().update_variable_names))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        _assert_skip_rolls_back(
            self, sess, train_op,
            lambda seed, nan=False: {x: _batch(rank, seed, nan),
                                     **training_feed},
            moving)

  @parameterized.named_parameters(
      (("InCond" if in_cond else "") + config, in_cond, config)
      for in_cond in (False, True) for config in sorted(_CONFIGS))
  def testHandWrittenMovingAveragesOverFusedBatchNorm(self, in_cond, config):
    # The classic hand-written batch norm: fused_batch_norm for the batch's
    # moments, assign_sub for the moving averages; behind `is_training`
    # these are written inside a tf.cond.
    with test_util.tf_config(*_CONFIGS[config]), tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 2, 2, 3])
      is_training = tf1.placeholder_with_default(True, [])
      gamma = tf1.get_variable("bn/gamma", initializer=tf.ones([3]))
      beta = tf1.get_variable("bn/beta", initializer=tf.zeros([3]))
      moving_mean = tf1.get_variable("bn/moving_mean", trainable=False,
                                     initializer=tf.zeros([3]))
      moving_variance = tf1.get_variable("bn/moving_variance",
                                         trainable=False,
                                         initializer=tf.ones([3]))
      y, mean, variance = tf1.nn.fused_batch_norm(x, gamma, beta,
                                                  is_training=True)

      def _update():
        return [tf1.assign_sub(moving_mean, (moving_mean - mean) * 0.1),
                tf1.assign_sub(moving_variance,
                               (moving_variance - variance) * 0.1)]

      if in_cond:
        updates = tf.cond(
            is_training, lambda: [tf.identity(u) for u in _update()],
            lambda: [tf.identity(moving_mean), tf.identity(moving_variance)])
      else:
        updates = _update()
      for update in updates:
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
      loss = tf.reduce_mean(tf.square(y - 1.0))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.minimize(loss)
      self.assertEqual(["bn/moving_mean", "bn/moving_variance"],
                       sorted(opt.guard_result().update_variable_names))
      self.assertEqual(_CONFIGS[config][1], hasattr(moving_mean, "handle"))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        _assert_skip_rolls_back(
            self, sess, train_op,
            lambda seed, nan=False: {x: _batch(4, seed, nan)},
            [moving_mean, moving_variance])


def _tower(i, x):
  """One tower of a replicated model: its own batch norm and loss."""
  with tf1.variable_scope("tower_%d" % i), tf1.name_scope("tower_%d" % i):
    y = tf1.layers.batch_normalization(x, training=True)
    return tf.reduce_mean(tf.square(y - 1.0))


class WhichUpdateOpsRunTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(("Unwrapped", False), ("Wrapped", True))
  def testReplicatedBenchmarkRunsOnlyTower0UpdateOps(self, wrapped):
    # tf_cnn_benchmarks' replicated mode: each tower has its own variables
    # and statistics; only tower 0's update ops are grouped into the train
    # op, after apply_gradients. Wrapping must not run tower 1's.
    with tf.Graph().as_default():
      xs = [tf1.placeholder(tf.float32, [4, 3]) for _ in range(2)]
      losses = [_tower(i, x) for i, x in enumerate(xs)]
      opt = tf1.train.GradientDescentOptimizer(0.1)
      if wrapped:
        opt = optimizer_lib.SkipNonFiniteOptimizer(opt)
      grads = opt.compute_gradients(tf.add_n(losses))
      apply_op = opt.apply_gradients(grads)
      tower_0_updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "tower_0")
      self.assertLen(tower_0_updates, 2)
      train_op = tf.group(apply_op, *tower_0_updates)
      if wrapped:
        self.assertEqual([], opt.guard_result().update_variable_names)
        train_op = opt.protect(train_op)
      moving = [[v for v in _moving_statistics()
                 if v.op.name.startswith("tower_%d/" % i)] for i in range(2)]
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = sess.run(moving)
        sess.run(train_op, {xs[0]: _batch(2, 1), xs[1]: _batch(2, 2)})
        after = sess.run(moving)
        for first, value in zip(initial[1], after[1]):
          self.assertTrue(np.array_equal(first, value))  # tower 1: frozen
        for first, value in zip(initial[0], after[0]):
          self.assertFalse(np.array_equal(first, value))
        if wrapped:
          # protect() rolls back tower 0's statistics on a skipped step.
          sess.run(train_op, {xs[0]: _batch(2, 3, nan=True),
                              xs[1]: _batch(2, 4)})
          for value, kept in zip(after[0] + after[1], sum(sess.run(moving),
                                                          [])):
            self.assertTrue(np.array_equal(value, kept), (value, kept))

  def testUpdateOpsTheGradientsDependOnAreFoundAndRolledBack(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3])
      loss = _tower(0, x)
      variables = tf1.trainable_variables()
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        grads = tf1.gradients(loss, variables)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.apply_gradients(list(zip(grads, variables)))
      moving = _moving_statistics()
      self.assertEqual(_names(moving),
                       sorted(opt.guard_result().update_variable_names))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        _assert_skip_rolls_back(
            self, sess, train_op,
            lambda seed, nan=False: {x: _batch(2, seed, nan)}, moving)

  def testSlimBarrierUpdateOpsAreFoundAndRolledBack(self):
    # tf-slim's create_train_op: the update ops are a barrier the loss
    # depends on, not control dependencies of apply_gradients.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3])
      loss = _tower(0, x)
      update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
      with tf1.control_dependencies(update_ops):
        loss = tf.identity(loss)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      grads = opt.compute_gradients(loss)
      train_op = tf.group(opt.apply_gradients(grads), loss)
      moving = _moving_statistics()
      self.assertEqual(_names(moving),
                       sorted(opt.guard_result().update_variable_names))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        _assert_skip_rolls_back(
            self, sess, train_op,
            lambda seed, nan=False: {x: _batch(2, seed, nan)}, moving)


if __name__ == "__main__":
  tf.test.main()
