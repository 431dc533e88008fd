"""Tests for ops outside the decision: `SkipNonFiniteOptimizer.protect` and
the default choice of `UPDATE_OPS`."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import shadows

tf1 = tf.compat.v1

# (control flow v2, resource variables); the default is (True, True). Ref
# variables only with cond v1, as `tf.compat.v1.disable_v2_behavior()` sets
# them: under cond v2, TF 2.21's own ExponentialMovingAverage cannot
# initialize the average of a ref variable ("Attempting to use uninitialized
# value"), wrapper or not.
_CONFIGS = (
    ("Default", True, True),
    ("CondV1", False, True),
    ("CondV1RefVariables", False, False),
)


def _legacy_ema_step(x, protect=True, whole_train_op=True, update_ops=()):
  """Legacy code: EMA built after apply_gradients, grouped into the train op.

  Args:
    x: the input placeholder.
    protect: if False, the train op is left as legacy code builds it.
    whole_train_op: protect the grouped train op (else only the EMA op).
    update_ops: run under `control_dependencies` with apply_gradients.

  Returns:
    (train_op, model variables, their EMA shadows, the optimizer).
  """
  loss, var_list = test_util.model(x)
  global_step = tf1.train.get_or_create_global_step()
  opt = optimizer_lib.SkipNonFiniteOptimizer(
      tf1.train.MomentumOptimizer(0.1, 0.9))
  with tf1.control_dependencies(update_ops):
    apply_op = opt.minimize(loss, global_step=global_step)
  ema = tf1.train.ExponentialMovingAverage(0.9, num_updates=global_step)
  with tf1.control_dependencies([apply_op]):
    ema_op = ema.apply(var_list)
  if protect and not whole_train_op:
    ema_op = opt.protect(ema_op)
  train_op = tf.group(apply_op, ema_op)
  if protect and whole_train_op:
    train_op = opt.protect(train_op)
  return train_op, var_list, [ema.average(v) for v in var_list], opt


def _values(sess, variables):
  return [np.copy(v) for v in sess.run(variables)]


def _assert_bit_identical(test, expected, actual):
  test.assertLen(actual, len(expected))
  test.assertNotEmpty(expected)
  for e, a in zip(expected, actual):
    test.assertTrue(np.array_equal(e, a), "%r != %r" % (e, a))


def _shadow_names():
  return sorted(v.op.name for v in tf1.global_variables()
                if "skip_shadow" in v.op.name)


def _shadowed_names():
  """Names of the variables the graph's rollback shadows hold."""
  return sorted(op.name for held in
                shadows.shadowed(tf1.get_default_graph()).values()
                for op in held)


class ProtectTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*_CONFIGS)
  def testEmaShadowsBitIdenticalOnSkippedStep(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      train_op, var_list, averages, _ = _legacy_ema_step(x)
      self.assertEqual(resource, hasattr(averages[0], "handle"))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = _values(sess, averages)
        sess.run(train_op, {x: test_util.GOOD_X})
        before = _values(sess, var_list + averages)
        for old, new in zip(initial, before[len(var_list):]):
          self.assertFalse(np.array_equal(old, new))
        sess.run(train_op, {x: test_util.NAN_X})
        _assert_bit_identical(self, before, _values(sess, var_list + averages))
        sess.run(train_op, {x: test_util.GOOD_X2})
        for old, new in zip(before, _values(sess, var_list + averages)):
          self.assertTrue(np.isfinite(new).all())
          self.assertFalse(np.array_equal(old, new))

  def testWithoutProtectEmaShadowsMoveOnSkippedStep(self):
    # Why protect exists: the weights are skipped, the EMA still decays
    # toward them (shadow -= (1 - decay) * (shadow - var)).
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      train_op, var_list, averages, _ = _legacy_ema_step(x, protect=False)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})
        weights, shadows = _values(sess, var_list), _values(sess, averages)
        sess.run(train_op, {x: test_util.NAN_X})
        _assert_bit_identical(self, weights, _values(sess, var_list))
        for old, new in zip(shadows, _values(sess, averages)):
          self.assertFalse(np.array_equal(old, new))

  def testProtectingOnlyTheEmaOpIsEnough(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      train_op, _, averages, _ = _legacy_ema_step(x, whole_train_op=False)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})
        shadows = _values(sess, averages)
        sess.run(train_op, {x: test_util.NAN_X})
        _assert_bit_identical(self, shadows, _values(sess, averages))

  def testAppliedStepsEqualUnprotected(self):
    results = []
    for protect in (True, False):
      with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3])
        train_op, var_list, averages, _ = _legacy_ema_step(x, protect)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          for batch in (test_util.GOOD_X, test_util.GOOD_X2, test_util.GOOD_X):
            sess.run(train_op, {x: batch})
          results.append(_values(sess, var_list + averages))
    _assert_bit_identical(self, results[1], results[0])

  def testLeavesGlobalStepCountersAndUpdateOpsToTheStep(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      stat = tf1.get_variable("stat", initializer=tf.constant(1.0),
                              trainable=False)
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                            tf1.assign_sub(stat, 0.5 * tf.reduce_sum(x)))
      train_op, var_list, averages, _ = _legacy_ema_step(
          x, update_ops=tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
      # The EMA shadows and the statistic (the step's own) are shadowed,
      # not global_step, the counters or the weights.
      self.assertEqual(sorted(["stat"] + [a.op.name for a in averages]),
                       _shadowed_names())
      counters = list(counters_lib.skip_counters())
      global_step = tf1.train.get_global_step()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})
        before = _values(sess, var_list + averages + [stat])
        sess.run(train_op, {x: test_util.NAN_X})
        _assert_bit_identical(self, before,
                              _values(sess, var_list + averages + [stat]))
        self.assertEqual([1, 1, 1], sess.run(counters))
        self.assertEqual(2, sess.run(global_step))

  def testProtectsAnyWrittenVariable(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      seen = tf1.get_variable("examples_seen", initializer=tf.constant(0.0),
                              trainable=False)
      table = tf1.get_variable("table", initializer=tf.zeros([4]),
                               trainable=False)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      apply_op = opt.minimize(loss)
      with tf1.control_dependencies([apply_op]):
        bookkeeping = tf.group(
            tf.identity(tf1.assign_add(seen, 3.0)),
            tf1.scatter_add(table, [1], [tf.reduce_sum(x)]))
      train_op = opt.protect([apply_op, bookkeeping])
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})
        self.assertEqual(3.0, sess.run(seen))
        sess.run(train_op, {x: test_util.NAN_X})
        self.assertEqual(3.0, sess.run(seen))
        self.assertTrue(np.array_equal([0.0, 1.0, 0.0, 0.0], sess.run(table)))
        sess.run(train_op, {x: test_util.GOOD_X2})
        self.assertEqual(6.0, sess.run(seen))
        self.assertTrue(np.array_equal([0.0, 2.5, 0.0, 0.0], sess.run(table)))

  def testOpWritingNothingOfItsOwnAddsNoShadow(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, var_list = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.protect(opt.minimize(
          loss, global_step=tf1.train.get_or_create_global_step()))
      self.assertEqual([], _shadow_names())
      self.assertEqual("Operation", type(train_op).__name__)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})
        before = _values(sess, var_list)
        sess.run(train_op, {x: test_util.NAN_X})
        _assert_bit_identical(self, before, _values(sess, var_list))
        self.assertEqual(2, sess.run(tf1.train.get_global_step()))

  def testRaisesBeforeApplyGradients(self):
    with tf.Graph().as_default():
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      with self.assertRaisesRegex(ValueError, "apply_gradients"):
        opt.protect(tf.no_op())

  def testShadowsAreSavedAndRestoredAfterARestart(self):
    path = self.get_temp_dir() + "/protect"
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      train_op, _, averages, _ = _legacy_ema_step(x)
      shadow_names = _shadow_names()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = _values(sess, averages)
        for batch in (test_util.GOOD_X, test_util.GOOD_X2):
          sess.run(train_op, {x: batch})
        saved = _values(sess, averages)
        tf1.train.Saver().save(sess, path)
    in_checkpoint = [name for name, _ in tf.train.list_variables(path)]
    self.assertNotEmpty(shadow_names)
    for name in shadow_names:
      self.assertIn(name, in_checkpoint)
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      train_op, _, averages, _ = _legacy_ema_step(x)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        tf1.train.Saver().restore(sess, path)
        sess.run(train_op, {x: test_util.NAN_X})
        after_nan = _values(sess, averages)
    _assert_bit_identical(self, saved, after_nan)
    for first, value in zip(initial, after_nan):
      self.assertFalse(np.array_equal(first, value))


def _tower_update_ops():
  """Two towers' update ops, each counting its own runs, in UPDATE_OPS."""
  runs = []
  for i in range(2):
    with tf1.name_scope("tower_%d" % i):
      count = tf1.get_variable("tower_%d_runs" % i, initializer=tf.constant(0),
                               trainable=False)
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                            tf1.assign_add(count, 1))
      runs.append(count)
  return runs


class DefaultUpdateOpsTest(tf.test.TestCase, parameterized.TestCase):

  def _runs(self, train_op, x, runs):
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(train_op, {x: test_util.GOOD_X})
      sess.run(train_op, {x: test_util.GOOD_X2})
      applied = sess.run(runs)
      sess.run(train_op, {x: test_util.NAN_X})
      self.assertEqual(applied, sess.run(runs))  # Rolled back.
      return applied

  @parameterized.named_parameters(("Ops", False), ("Group", True))
  def testOnlyTheCallersControlDependenciesRun(self, grouped):
    # Legacy multi-tower code: only the first tower's statistics, under
    # control_dependencies; the wrapper must not run the other tower's.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      runs = _tower_update_ops()
      loss, _ = test_util.model(x)
      first = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "tower_0")
      self.assertLen(first, 1)
      if grouped:
        first = [tf.group(*first)]
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      with tf1.control_dependencies(first):
        train_op = opt.minimize(loss)
      self.assertEqual([2, 0], self._runs(train_op, x, runs))

  def testWithoutControlDependenciesNoUpdateOpRuns(self):
    # Wrapping never makes a step run an update op the script did not run
    # (before, every UPDATE_OPS entry ran: issue 12, item 6).
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      runs = _tower_update_ops()
      loss, _ = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.minimize(loss)
      self.assertEqual([0, 0], self._runs(train_op, x, runs))
      self.assertEqual([], opt.guard_result().update_variable_names)

  def testUnrelatedControlDependenciesRunNoUpdateOp(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      runs = _tower_update_ops()
      loss, _ = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      with tf1.control_dependencies([tf.identity(x)]):
        train_op = opt.minimize(loss)
      self.assertEqual([0, 0], self._runs(train_op, x, runs))

  def testExplicitUpdateOpsWin(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      runs = _tower_update_ops()
      loss, _ = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1),
          update_ops=tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "tower_1"))
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "tower_0")):
        train_op = opt.minimize(loss)
      # Both run (tower 0 by the caller's control dependency), but only tower
      # 1's count is rolled back: tower 0's moves on the skipped step.
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})
        self.assertEqual([1, 1], sess.run(runs))
        sess.run(train_op, {x: test_util.NAN_X})
        self.assertEqual([2, 1], sess.run(runs))


if __name__ == "__main__":
  tf.test.main()
