"""In-place batch norm in a GAN, wrapped with the one line (issue 22, 4 and 6).

The structure of a DCGAN script: batch norm with `updates_collections=None`
(the moving statistics assigned in the forward pass, the normalized output
under a control dependency on the assign, nothing in `UPDATE_OPS`), a
generator and a discriminator applied to real and generated batches, two
wrapped optimizers (D and G), a plain `Session` fed by `feed_dict`, and an
evaluation of a loss between steps (which runs the in-place update too).
"""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import shadows

tf1 = tf.compat.v1

# name -> (control flow v2, resource variables), for test_util.tf_config.
_CONFIGS = (("CondV2", True, True), ("CondV1", False, True),
            ("CondV1RefVariables", False, False))


def _batch_norm(x, training, scope):
  """Batch norm that writes its moving statistics in the forward pass."""
  with tf1.variable_scope(scope):
    size = x.shape[-1]
    beta = tf1.get_variable("beta", [size], initializer=tf1.zeros_initializer())
    gamma = tf1.get_variable("gamma", [size],
                             initializer=tf1.ones_initializer())
    moving_mean = tf1.get_variable("moving_mean", [size], trainable=False,
                                   initializer=tf1.zeros_initializer())
    moving_variance = tf1.get_variable("moving_variance", [size],
                                       trainable=False,
                                       initializer=tf1.ones_initializer())
    mean, variance = tf.nn.moments(x, [0])

    def _force_updates():
      updates = [tf1.assign_sub(moving_mean, (moving_mean - mean) * 0.1),
                 tf1.assign_sub(moving_variance,
                                (moving_variance - variance) * 0.1)]
      with tf1.control_dependencies(updates):
        return tf.identity(mean), tf.identity(variance)

    if training is True:
      mean, variance = _force_updates()
    else:  # A tensor: the assigns inside a cond.
      mean, variance = tf.cond(training, _force_updates,
                               lambda: (tf.identity(mean),
                                        tf.identity(variance)))
    return tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-5)


def _dense(x, units, name, seed):
  with tf1.variable_scope(name):
    w = tf1.get_variable(
        "w", [x.shape[-1], units],
        initializer=tf1.random_normal_initializer(stddev=0.5, seed=seed))
    return tf.matmul(x, w)


def _generator(z, training):
  with tf1.variable_scope("generator"):
    h = tf.nn.relu(_batch_norm(_dense(z, 4, "h0", 1), training, "bn0"))
    return tf.tanh(_dense(h, 3, "h1", 2))


def _discriminator(x, training, reuse=False):
  with tf1.variable_scope("discriminator", reuse=reuse):
    h = tf.nn.leaky_relu(_batch_norm(_dense(x, 4, "h0", 3), training, "bn0"))
    return _dense(h, 1, "h1", 4)


class _Gan(object):
  """The graph: losses, the two wrapped steps, the moving statistics."""

  def __init__(self, training=True, update_ops=None, protect=False):
    self.real = tf1.placeholder(tf.float32, [4, 3], name="real")
    self.z = tf1.placeholder(tf.float32, [4, 2], name="z")
    fake = _generator(self.z, training)
    d_real = _discriminator(self.real, training)
    d_fake = _discriminator(fake, training, reuse=True)

    def xent(logits, label):
      return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
          labels=tf.fill(tf.shape(logits), label), logits=logits))

    self.d_loss_real = xent(d_real, 1.0)
    d_loss = self.d_loss_real + xent(d_fake, 0.0)
    g_loss = xent(d_fake, 1.0)
    variables = tf1.trainable_variables()
    self.opts, self.steps = [], []
    for loss, prefix in ((d_loss, "discriminator/"), (g_loss, "generator/")):
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.AdamOptimizer(0.01, beta1=0.5), update_ops=update_ops)
      step = opt.minimize(loss, var_list=[v for v in variables
                                          if v.op.name.startswith(prefix)])
      self.opts.append(opt)
      self.steps.append(opt.protect(step) if protect else step)
    self.statistics = [v for v in tf1.global_variables()
                       if "moving_" in v.op.name and
                       "skip_shadow" not in v.op.name]

  def feed(self, seed, nan_real=False, nan_z=False):
    rng = np.random.RandomState(seed)
    real = rng.rand(4, 3).astype(np.float32)
    z = rng.uniform(-1, 1, [4, 2]).astype(np.float32)
    if nan_real:
      real[1, 2] = np.nan
    if nan_z:
      z[0, 1] = np.nan
    return {self.real: real, self.z: z}


def _values(sess, variables):
  return [np.copy(v) for v in sess.run(variables)]


class InPlaceStatisticsTest(tf.test.TestCase, parameterized.TestCase):

  def _assert_identical(self, expected, actual):
    self.assertNotEmpty(expected)
    for e, a in zip(expected, actual):
      self.assertTrue(np.array_equal(e, a), "%r != %r" % (e, a))

  def _assert_skips_leave_statistics(self, gan):
    """A D step on a NaN real batch and a G step on a NaN z change no
    statistic; good steps around them move them, finitely."""
    d_step, g_step = gan.steps
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      initial = _values(sess, gan.statistics)
      sess.run(d_step, gan.feed(1))
      sess.run(g_step, gan.feed(2))
      moved = _values(sess, gan.statistics)
      for first, now in zip(initial, moved):
        self.assertFalse(np.array_equal(first, now))
      for step, opt, feed in ((d_step, gan.opts[0], gan.feed(3, nan_real=True)),
                              (g_step, gan.opts[1], gan.feed(4, nan_z=True))):
        before = _values(sess, gan.statistics)
        _, applied = sess.run([step, opt.applied()], feed)
        self.assertFalse(applied)
        self._assert_identical(before, _values(sess, gan.statistics))
      sess.run(d_step, gan.feed(5))
      sess.run(g_step, gan.feed(6))
      after = _values(sess, gan.statistics)
      for value in after:
        self.assertTrue(np.isfinite(value).all(), value)

  @parameterized.named_parameters(*_CONFIGS)
  def testTheOneLineRollsBackInPlaceStatistics(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      gan = _Gan()
      # Both steps run both networks' batch norms (D on generated batches).
      self.assertLen(gan.statistics, 4)
      for opt in gan.opts:
        self.assertEqual(
            sorted(v.op.name for v in gan.statistics),
            sorted(opt.guard_result().update_variable_names))
        self.assertEqual([], opt.check_train_op(opt.guard_result().train_op))
      self._assert_skips_leave_statistics(gan)

  @parameterized.named_parameters(*_CONFIGS)
  def testAssignsInsideACondWithATensorTraining(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      gan = _Gan(training=tf1.placeholder_with_default(True, []))
      for opt in gan.opts:
        self.assertEqual(
            sorted(v.op.name for v in gan.statistics),
            sorted(opt.guard_result().update_variable_names))
      self._assert_skips_leave_statistics(gan)

  def testProtectCoversThemWhenOtherUpdateOpsAreGiven(self):
    # The warning's advice, `opt.protect(train_op)`, for a wrapper told
    # which update ops to roll back (none here).
    with tf.Graph().as_default():
      unprotected = _Gan(update_ops=[])
      names = unprotected.opts[0].check_train_op(unprotected.steps[0])
      self.assertEqual(sorted(v.op.name for v in unprotected.statistics),
                       names)
    with tf.Graph().as_default():
      gan = _Gan(update_ops=[], protect=True)
      for opt, step in zip(gan.opts, gan.steps):
        self.assertEqual([], opt.check_train_op(step))
      self._assert_skips_leave_statistics(gan)


class RunBeforeTest(tf.test.TestCase):
  """Which forward-pass writes a step takes (`in_place.run_before`)."""

  def testTakesStatisticsNotTheStepsOwnVariablesLoopsOrDecisions(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3])
      global_step = tf1.train.get_or_create_global_step()
      w = tf1.get_variable("w", [3, 2])
      # A loss that waits for global_step's increment: the step's own.
      with tf1.control_dependencies([tf1.assign_add(global_step, 1)]):
        h = tf.matmul(x, w)
      # A write inside a while loop: not analysable here.
      looped = tf1.get_variable("looped", [], trainable=False)
      _, h = tf.while_loop(
          lambda i, t: i < 2,
          lambda i, t: (i + 1, t + tf1.assign_add(looped, 1.0)), [0, h])
      first = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.MomentumOptimizer(0.1, 0.9))
      first_step = first.minimize(tf.reduce_sum(_batch_norm(h, True, "bn")))
      # A second step that runs after the first: the first's decision
      # (its optimizer's slots, the counters) is not the second's to undo.
      # Its own step counter, in no collection, bumped by its forward pass.
      counter = tf1.Variable(0, trainable=False, name="counter",
                             collections=[tf1.GraphKeys.LOCAL_VARIABLES])
      with tf1.control_dependencies([first_step,
                                     tf1.assign_add(counter, 1)]):
        loss = tf.reduce_sum(tf.square(tf.matmul(x, w)))
      second = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      second.minimize(loss, global_step=counter)
      self.assertEqual(["bn/moving_mean", "bn/moving_variance"],
                       sorted(first.guard_result().update_variable_names))
      self.assertEqual([], second.guard_result().update_variable_names)
      held = set().union(*shadows.shadowed(tf1.get_default_graph()).values())
      self.assertNotIn(counter.op, held)  # Not rolled back: no shadow.
      self.assertIn("bn/moving_mean", [op.name for op in held])


class WhatASkipRestoresTest(tf.test.TestCase):
  """A skip restores the statistics' value after the last guarded step.

  Not their value just before the skipped step: a run outside the guarded
  steps (DCGAN evaluates `d_loss_real`, which runs the in-place update)
  writes them without a copy, and a skip undoes that write; the same undoes
  a NaN such a run wrote. `sync_shadows` adopts such a write.
  """

  def testASkipUndoesWritesOfRunsOutsideTheSteps(self):
    with tf.Graph().as_default():
      gan = _Gan()
      d_step, g_step = gan.steps
      sync = shadows.sync_shadows()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(d_step, gan.feed(1))
        sess.run(g_step, gan.feed(2))
        after_steps = _values(sess, gan.statistics)
        sess.run(gan.d_loss_real, gan.feed(3))  # Writes D's statistics.
        after_eval = _values(sess, gan.statistics)
        self.assertFalse(np.array_equal(after_steps[2], after_eval[2]))
        _, applied = sess.run([d_step, gan.opts[0].applied()],
                              gan.feed(4, nan_real=True))
        self.assertFalse(applied)
        for expected, value in zip(after_steps, _values(sess, gan.statistics)):
          self.assertTrue(np.array_equal(expected, value))

        # An evaluation on a NaN batch: the next step sees NaN statistics,
        # is skipped, and takes them back to their last applied value.
        sess.run(gan.d_loss_real, gan.feed(5, nan_real=True))
        self.assertTrue(np.isnan(sess.run(gan.statistics[2])).all())
        _, applied = sess.run([d_step, gan.opts[0].applied()], gan.feed(6))
        self.assertFalse(applied)
        for expected, value in zip(after_steps, _values(sess, gan.statistics)):
          self.assertTrue(np.array_equal(expected, value))

        # To keep what such a run wrote, sync the shadows after it.
        sess.run(gan.d_loss_real, gan.feed(7))
        sess.run(sync)
        after_eval = _values(sess, gan.statistics)
        _, applied = sess.run([d_step, gan.opts[0].applied()],
                              gan.feed(8, nan_real=True))
        self.assertFalse(applied)
        for expected, value in zip(after_eval, _values(sess, gan.statistics)):
          self.assertTrue(np.array_equal(expected, value))


class RunsBetweenStepsTest(tf.test.TestCase):
  """Issue 33, item 6: a run between steps that writes the statistics.

  DCGAN's loop evaluates `d_loss_real` on the batch again for its
  printouts; that run writes the discriminator's in-place statistics (a
  NaN, on a bad batch: the next step skips too). The script is told so at
  that run, once, in one line.
  """

  def testDcganLoopIsToldOnceInOneLine(self):
    with tf.Graph().as_default():
      gan = _Gan()
      d_optim, g_optim = gan.steps
      d_loss_real = gan.d_loss_real
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        with self.assertLogs(level="WARNING") as logs:
          for step in range(3):
            feed = gan.feed(step, nan_real=step == 1)
            sess.run(d_optim, feed)
            sess.run(g_optim, feed)
            d_loss_real.eval(feed)  # DCGAN: errD_real, for its printout
    told = [l for l in logs.output if "executes no guarded step" in l]
    self.assertLen(told, 1, logs.output)
    self.assertNotIn("\n", told[0])
    self.assertIn("discriminator/bn0/moving_mean", told[0])
    self.assertIn("`sess.run([d_optim, d_loss_real], feed_dict)`", told[0])


if __name__ == "__main__":
  tf.test.main()
