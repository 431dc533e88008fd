"""Tests for tf1_safe_train.core.rollback and .writes; legacy UPDATE_OPS."""

import contextlib
from unittest import mock

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
import tf1_safe_train
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import rollback
from tf1_safe_train.core import shadows
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

_NAN = float("nan")


@contextlib.contextmanager
def _ref_variables():
  """Legacy ref variables for the block; resource variables again after."""
  was_enabled = tf1.resource_variables_enabled()
  tf1.disable_resource_variables()
  try:
    yield
  finally:
    if was_enabled:
      tf1.enable_resource_variables()


@contextlib.contextmanager
def _maybe_ref_variables(use_ref):
  if use_ref:
    with _ref_variables():
      yield
  else:
    yield


def _names(variables):
  return [v.op.name for v in variables]


def _shadow_names():
  return [n for n in _names(tf1.global_variables()) if "skip_shadow" in n]


class WrittenVariablesTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(("Resource", False), ("Ref", True))
  def testFindsAssignSubAssignAndAssignAddTargets(self, use_ref):
    with _maybe_ref_variables(use_ref), tf.Graph().as_default():
      a = tf1.get_variable("a", initializer=tf.constant([1.0, 2.0]))
      b = tf1.get_variable("b", initializer=tf.constant([1.0, 2.0]))
      c = tf1.get_variable("c", initializer=tf.constant([1.0, 2.0]))
      d = tf1.get_variable("d", initializer=tf.constant([1.0, 2.0]))
      self.assertEqual(not use_ref, hasattr(a, "handle"))
      updates = [tf1.assign_sub(a, [0.5, 0.5]), tf1.assign(b, [3.0, 4.0]),
                 tf1.assign_add(c, [1.0, 1.0]),
                 tf1.scatter_update(d, [0], [9.0])]
      expected_types = (
          ["AssignSub", "Assign", "AssignAdd", "ScatterUpdate"] if use_ref
          else ["AssignSubVariableOp", "AssignVariableOp",
                "AssignAddVariableOp", "ResourceScatterUpdate"])
      self.assertEqual(expected_types,
                       [rollback.as_op(u).type for u in updates])
      self.assertEqual(["a", "b", "c", "d"],
                       _names(rollback.written_variables(updates)))
      for update, name in zip(updates, "abcd"):
        self.assertEqual([name], _names(rollback.written_variables([update])))

  def testFindsTargetThroughUnreadVariableIdentityAndGroup(self):
    with tf.Graph().as_default():
      a = tf1.get_variable("a", initializer=tf.constant([1.0]))
      b = tf1.get_variable("b", initializer=tf.constant([1.0]))
      c = tf1.get_variable("c", initializer=tf.constant([1.0]))
      d = tf1.get_variable("d", initializer=tf.constant([1.0]))
      unread = tf1.assign_sub(a, [0.5])
      self.assertEqual("_UnreadVariable", type(unread).__name__)
      identity = tf.identity(tf1.assign_sub(b, [0.5]))
      self.assertEqual("Identity", identity.op.type)
      group = tf.group(tf1.assign_sub(c, [0.5]), name="bn_updates")
      self.assertEqual("NoOp", group.type)
      nested = tf.group(tf.identity(tf.identity(tf1.assign_sub(d, [0.5]))))
      self.assertEqual(["a"], _names(rollback.written_variables([unread])))
      self.assertEqual(["b"], _names(rollback.written_variables([identity])))
      self.assertEqual(["c"], _names(rollback.written_variables([group])))
      self.assertEqual(["d"], _names(rollback.written_variables([nested])))
      self.assertEqual(
          ["a", "b", "c", "d"],
          _names(rollback.written_variables([nested, group, identity,
                                             unread])))

  def testFindsRefVariableThroughIdentityAndGroup(self):
    with _ref_variables(), tf.Graph().as_default():
      a = tf1.get_variable("a", initializer=tf.constant([1.0]))
      b = tf1.get_variable("b", initializer=tf.constant([1.0]))
      identity = tf.identity(tf1.assign_sub(a, [0.5]))
      group = tf.group(tf1.assign_sub(b, [0.5]))
      self.assertEqual(["a", "b"],
                       _names(rollback.written_variables([group, identity])))

  def testDoesNotWalkIntoTheForwardPass(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [8, 8])
      # A forward pass that itself writes a variable and reads many.
      steps_seen = tf1.get_variable("steps_seen", initializer=tf.constant(0.0),
                                    trainable=False)
      seen_update = tf1.assign_add(steps_seen, 1.0)
      h = x * tf.identity(seen_update)
      for i in range(30):
        w = tf1.get_variable("w%d" % i, initializer=tf.eye(8))
        h = tf.identity(tf.nn.relu(tf.matmul(h, w)))
      moving_mean = tf1.get_variable("moving_mean", initializer=tf.zeros([8]),
                                     trainable=False)
      with tf1.control_dependencies([seen_update]):
        update = tf1.assign_sub(
            moving_mean, (moving_mean - tf.reduce_mean(h, 0)) * 0.1)
      self.assertEqual(
          ["moving_mean"],
          _names(rollback.written_variables([update, tf.identity(update)])))
      # The forward pass really does write steps_seen.
      self.assertEqual(["steps_seen"],
                       _names(rollback.written_variables([seen_update])))

  def testNoUpdateOpsIsEmpty(self):
    self.assertEqual([], rollback.written_variables([]))
    self.assertEqual([], rollback.written_variables(None))

  def testRaisesWhenTargetIsNotAGraphVariable(self):
    with tf.Graph().as_default():
      hidden = tf1.Variable([1.0], collections=[], name="hidden")
      with self.assertRaisesRegex(ValueError, "hidden"):
        rollback.written_variables([tf1.assign_sub(hidden, [0.5])])

  def testFindsLocalVariables(self):
    with tf.Graph().as_default():
      local = tf1.get_variable(
          "local", initializer=tf.constant([1.0]),
          collections=[tf1.GraphKeys.LOCAL_VARIABLES])
      self.assertEqual(
          ["local"],
          _names(rollback.written_variables([tf1.assign_sub(local, [1.0])])))


# name -> (control flow v2, resource variables), for test_util.tf_config.
_CONFIGS = (("CondV2", True, True), ("CondV1", False, True),
            ("CondV1RefVariables", False, False))


def _cond_write(pred, variable, value):
  """A cond that writes `variable` when `pred`, else only reads it."""
  return tf.cond(pred,
                 lambda: tf.identity(tf1.assign_sub(variable, value)),
                 lambda: tf.identity(variable.read_value()))


class CondWritesTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*_CONFIGS)
  def testFindsWriteInsideCondButNotTheForwardPass(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      pred = tf1.placeholder_with_default(True, [])
      seen = tf1.get_variable("seen", initializer=tf.constant([0.0]),
                              trainable=False)
      moving_mean = tf1.get_variable("moving_mean",
                                     initializer=tf.constant([0.0]),
                                     trainable=False)
      # The value the cond takes in comes from a forward pass that itself
      # writes a variable: not an update op's write.
      value = tf.identity(tf1.assign_add(seen, [1.0])) * 0.1
      update = _cond_write(pred, moving_mean, value)
      self.assertEqual(["moving_mean"],
                       _names(rollback.written_variables([update])))
      written, others = rollback.find_writes([update])
      self.assertTrue(all(writes.in_control_flow(op) for op, _ in written))
      self.assertLen(others, 1)  # the cond's If or Merge

  @parameterized.named_parameters(*_CONFIGS)
  def testFindsWritesInNestedConds(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      outer = tf1.placeholder_with_default(True, [])
      inner = tf1.placeholder_with_default(True, [])
      a, b = [tf1.get_variable(n, initializer=tf.constant([1.0]),
                               trainable=False) for n in "ab"]

      def _outer_true():
        # Computed inside the outer branch: the inner cond's input.
        half = tf.identity(tf1.assign_sub(a, [0.5])) * 0.5
        return _cond_write(inner, b, half)

      update = tf.cond(outer, _outer_true, lambda: tf.identity(b.read_value()))
      self.assertEqual(["a", "b"],
                       _names(rollback.written_variables([update])))

  def testFindsWriteInASwitchCaseBranch(self):
    with tf.Graph().as_default():
      index = tf1.placeholder_with_default(1, [])
      a, b = [tf1.get_variable(n, initializer=tf.constant([1.0]),
                               trainable=False) for n in "ab"]
      update = tf.switch_case(index, [
          lambda: tf.identity(a.read_value()),
          lambda: tf.identity(tf1.assign_sub(b, [0.5]))])
      self.assertEqual("Case", update.op.inputs[0].op.type)
      self.assertEqual(["b"], _names(rollback.written_variables([update])))

  @parameterized.named_parameters(*_CONFIGS)
  def testCondThatWritesNothingIsFine(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      pred = tf1.placeholder_with_default(True, [])
      a = tf1.get_variable("a", initializer=tf.constant([1.0]))
      update = tf.cond(pred, lambda: tf.identity(a.read_value()),
                       lambda: tf.identity(a.read_value() * 2.0))
      self.assertEqual([], rollback.written_variables([update]))

  @parameterized.named_parameters(*_CONFIGS)
  def testStatisticsDeltasRefusesWriteInsideCond(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      pred = tf1.placeholder_with_default(True, [])
      moving_mean = tf1.get_variable("bn/moving_mean",
                                     initializer=tf.constant([0.0]),
                                     trainable=False)
      update = _cond_write(pred, moving_mean, [0.5])
      with self.assertRaisesRegex(ValueError,
                                  r"^update op \S+ writes bn/moving_mean "
                                  r"inside a cond[^\n]*$"):
        rollback.statistics_deltas([update])

  def testDecisionCondsAreNotEntered(self):
    with tf.Graph().as_default():
      pred = tf1.placeholder_with_default(True, [])
      a = tf1.get_variable("a", initializer=tf.constant([1.0]))
      decided = _cond_write(pred, a, [0.5])
      self.assertEqual(["a"], _names(rollback.written_variables([decided])))
      writes.register_decision(decided)
      self.assertEqual([], rollback.written_variables([decided]))


def _scatter_mul(variable):
  return tf1.scatter_mul(variable, [0], [2.0])


def _while_assign_add(variable):
  def _body(i):
    with tf1.control_dependencies([tf1.assign_add(variable, [1.0])]):
      return i + 1
  return tf.nest.flatten(
      tf.while_loop(lambda i: i < 3, _body, [tf.constant(0)]))[0]


def _function_call(variable):
  @tf.function
  def _add():
    variable.assign_add([1.0])
    return tf.constant(1.0)
  return _add()


def _scatter_mul_in_cond(variable):
  return tf.cond(tf1.placeholder_with_default(True, []),
                 lambda: tf.identity(_scatter_mul(variable)),
                 lambda: tf.identity(variable.read_value()))


class UnanalysableWritesTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      (name + config[0], make) + config[1:]
      for name, make in (("ScatterMul", _scatter_mul),
                         ("WhileLoop", _while_assign_add),
                         ("ScatterMulInCond", _scatter_mul_in_cond))
      for config in _CONFIGS)
  def testRefusedInOneLineNamingOpAndVariable(self, make, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      stat = tf1.get_variable("stat", initializer=tf.constant([1.0]),
                              trainable=False)
      update = make(stat)
      with self.assertRaisesRegex(ValueError,
                                  r"^update op \S+ \(\w+\) [^\n]*\bstat\b"
                                  r"[^\n]*$"):
        rollback.written_variables([update])

  def testUnknownWriteOfAVariableOutsideTheCollectionsIsRefused(self):
    with tf.Graph().as_default():
      hidden = tf1.Variable([1.0], collections=[], name="hidden")
      with self.assertRaisesRegex(
          ValueError, r"^update op \S+ \(ResourceScatterMul\) may write "
          r"hidden \(not a global or local variable\);[^\n]*$"):
        rollback.written_variables([_scatter_mul(hidden)])

  def testFunctionCallIsRefused(self):
    with tf.Graph().as_default():
      stat = tf1.get_variable("stat", initializer=tf.constant([1.0]),
                              trainable=False)
      update = _function_call(stat)
      with self.assertRaisesRegex(
          ValueError,
          r"^update op \S+ \(StatefulPartitionedCall\) may write stat;"
          r"[^\n]*$"):
        rollback.written_variables([update])

  @parameterized.named_parameters(*_CONFIGS)
  def testOpsThatWriteNothingAreFine(self, cf_v2, resource):
    with test_util.tf_config(cf_v2, resource), tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loop = tf.while_loop(lambda i, s: i < 3,
                           lambda i, s: (i + 1, s * 2.0),
                           [tf.constant(0), x])
      printed = tf.print(x)
      table = tf1.get_variable("table", initializer=tf.ones([4, 3]))
      gathered = tf.identity(tf.gather(table, [0, 2]))  # ResourceGather
      # A stateful op given a handle that is not a variable's.
      batch = tf1.data.make_one_shot_iterator(
          tf.data.Dataset.range(3)).get_next()
      self.assertEqual([], rollback.written_variables(
          [tf.identity(loop[1]), printed, gathered, tf.identity(batch)]))


class RollbackTest(tf.test.TestCase):

  def testShadowIsMadeOncePerVariableAndSaved(self):
    with tf.Graph().as_default():
      v = tf1.get_variable("bn/moving_mean", initializer=tf.constant([1.0]),
                           trainable=False)
      with tf1.name_scope("tower_1"):
        first = rollback.Rollback([v])
      second = rollback.Rollback([v])
      self.assertEqual([v], first.variables)
      shadows = [x for x in tf1.global_variables() if x is not v]
      self.assertEqual(["bn/moving_mean/skip_shadow"], _names(shadows))
      self.assertEmpty(tf1.trainable_variables())
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(tf1.assign(v, [7.0]))
        sess.run(second.commit())
        sess.run(tf1.assign(v, [_NAN]))
        sess.run(first.restore())
        self.assertTrue(np.array_equal([7.0], sess.run(v)))
        self.assertTrue(np.array_equal([7.0], sess.run(shadows[0])))

  def testSmallVariablesShareFlatShadowsOfBoundedSize(self):
    with tf.Graph().as_default(), mock.patch.object(
        shadows, "MAX_FLAT_ELEMENTS", 8):
      shapes = {"scalar": [], "vector": [3], "matrix": [2, 2], "big": [9],
                "more": [4], "ints": [2]}
      variables = [
          tf1.get_variable(name, shape, tf.int32 if name == "ints"
                           else tf.float32, tf1.zeros_initializer(),
                           trainable=False)
          for name, shape in shapes.items()]
      # A variable given twice is shadowed once.
      protected = rollback.Rollback(variables + variables[:1])
      held = sorted(sorted(op.name for op in ops) for ops in
                    shadows.shadowed(tf1.get_default_graph()).values())
      # 1 + 3 + 4 elements fill one flat shadow; "more" starts the next;
      # "big" exceeds the bound alone; ints are another dtype.
      self.assertEqual(held, [["big"], ["ints"], ["matrix", "scalar",
                                                   "vector"], ["more"]])
      commit, restore = protected.commit(), protected.restore()
      saved = [np.arange(np.prod(s), dtype=v.dtype.as_numpy_dtype).reshape(s)
               + 1 for v, s in zip(variables, shapes.values())]
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for v, value in zip(variables, saved):
          v.load(value, sess)
        sess.run(commit)
        for v in variables:
          v.load(np.zeros(v.shape, v.dtype.as_numpy_dtype) - 7, sess)
        sess.run(restore)
        for v, value in zip(variables, saved):
          self.assertAllEqual(value, sess.run(v))

  def testAVariableShadowedBeforeKeepsItsShadow(self):
    with tf.Graph().as_default():
      a, b, c = [tf1.get_variable(n, [2], trainable=False) for n in "abc"]
      first = rollback.Rollback([a, b])
      second = rollback.Rollback([b, c])
      self.assertLen(shadows.shadowed(tf1.get_default_graph()), 2)
      commit, restore = second.commit(), first.restore()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(first.commit())
        b.load([5.0, 6.0], sess)
        sess.run(commit)  # Saves b into the shadow it shares with a.
        b.load([_NAN, _NAN], sess)
        sess.run(restore)
        self.assertAllEqual([5.0, 6.0], sess.run(b))


def _legacy_net(images, labels):
  """Conv + hand-written batch norm + dense, legacy UPDATE_OPS style."""
  rng = np.random.RandomState(0)
  with tf1.variable_scope("net"):
    kernel = tf1.get_variable(
        "conv/kernel", initializer=rng.randn(3, 3, 1, 2).astype(np.float32))
    gamma = tf1.get_variable("bn/gamma", initializer=tf.ones([2]))
    beta = tf1.get_variable("bn/beta", initializer=tf.zeros([2]))
    moving_mean = tf1.get_variable("bn/moving_mean", initializer=tf.zeros([2]),
                                   trainable=False)
    moving_variance = tf1.get_variable(
        "bn/moving_variance", initializer=tf.ones([2]), trainable=False)
    dense = tf1.get_variable(
        "dense/kernel", initializer=rng.randn(2, 3).astype(np.float32))
  conv = tf.nn.conv2d(images, kernel, strides=1, padding="SAME")
  normed, mean, variance = tf1.nn.fused_batch_norm(
      conv, gamma, beta, is_training=True)
  decay = 0.9
  tf1.add_to_collection(
      tf1.GraphKeys.UPDATE_OPS,
      tf1.assign_sub(moving_mean, (moving_mean - mean) * (1 - decay)))
  tf1.add_to_collection(
      tf1.GraphKeys.UPDATE_OPS,
      tf1.assign_sub(moving_variance, (moving_variance - variance) *
                     (1 - decay)))
  logits = tf.matmul(tf.reduce_mean(tf.nn.relu(normed), [1, 2]), dense)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  return loss, moving_mean, moving_variance


def _legacy_train_op():
  """Builds the legacy net and its train op exactly like legacy code."""
  images = tf1.placeholder(tf.float32, [4, 4, 4, 1])
  labels = tf.constant([0, 1, 2, 0])
  loss, moving_mean, moving_variance = _legacy_net(images, labels)
  global_step = tf1.train.get_or_create_global_step()
  opt = optimizer_lib.SkipNonFiniteOptimizer(
      tf1.train.MomentumOptimizer(0.1, 0.9))
  update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
  with tf1.control_dependencies(update_ops):
    train_op = opt.minimize(loss, global_step=global_step)
  return images, train_op, (moving_mean, moving_variance)


def _batch(seed, nan=False):
  images = np.random.RandomState(seed).rand(4, 4, 4, 1).astype(np.float32)
  if nan:
    images[2, 1, 3, 0] = _NAN
  return images


def _state(sess):
  """Every global variable but the counters and global_step, by name."""
  skip = set(_names(counters_lib.skip_counters())) | {"global_step"}
  variables = [v for v in tf1.global_variables() if v.op.name not in skip]
  return dict(zip(_names(variables), sess.run(variables)))


class LegacyBatchNormTest(tf.test.TestCase, parameterized.TestCase):

  def _assertSameState(self, expected, actual):
    self.assertEqual(sorted(expected), sorted(actual))
    self.assertNotEmpty(expected)
    for name in expected:
      self.assertTrue(np.array_equal(expected[name], actual[name]),
                      "%s: %r != %r" % (name, expected[name], actual[name]))

  @parameterized.named_parameters(("Resource", False), ("Ref", True))
  def testSkipsNanBatchAndRollsBackMovingStatistics(self, use_ref):
    with _maybe_ref_variables(use_ref), tf.Graph().as_default():
      images, train_op, moving = _legacy_train_op()
      self.assertEqual(not use_ref, hasattr(moving[0], "handle"))
      shadow_names = _shadow_names()
      self.assertLen(shadow_names, 1)  # Both statistics share one.
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = sess.run(list(moving))
        sess.run(train_op, {images: _batch(1)})
        before = _state(sess)
        for name in shadow_names:
          self.assertIn(name, before)
        for name, value in zip(_names(moving), initial):
          self.assertFalse(np.array_equal(value, before[name]), name)

        sess.run(train_op, {images: _batch(2, nan=True)})
        after_nan = _state(sess)
        for name in _names(moving):
          self.assertTrue(np.isfinite(after_nan[name]).all(), name)
        self._assertSameState(before, after_nan)
        self.assertEqual([1, 1, 1], sess.run(list(
            counters_lib.skip_counters())))

        sess.run(train_op, {images: _batch(3)})
        after_good = _state(sess)
        for name in _names(moving) + ["net/conv/kernel", "net/dense/kernel"]:
          self.assertTrue(np.isfinite(after_good[name]).all(), name)
          self.assertFalse(np.array_equal(before[name], after_good[name]),
                           name)

  def testShadowsAreSavedAndRestoredAfterARestart(self):
    path = self.get_temp_dir() + "/legacy_bn"
    with tf.Graph().as_default():
      images, train_op, moving = _legacy_train_op()
      shadow_names = _shadow_names()
      self.assertLen(shadow_names, 1)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = sess.run(list(moving))
        for seed in (1, 2, 3):
          sess.run(train_op, {images: _batch(seed)})
        saved = sess.run(list(moving))
        tf1.train.Saver().save(sess, path)
    in_checkpoint = [name for name, _ in tf.train.list_variables(path)]
    for name in shadow_names:
      self.assertIn(name, in_checkpoint)

    with tf.Graph().as_default():
      images, train_op, moving = _legacy_train_op()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        tf1.train.Saver().restore(sess, path)
        sess.run(train_op, {images: _batch(4, nan=True)})
        after_nan = sess.run(list(moving))
    for value, restored, first in zip(after_nan, saved, initial):
      self.assertTrue(np.array_equal(restored, value), (restored, value))
      self.assertFalse(np.array_equal(first, value))

  def _restart_without_shadows(self, sync):
    """(initial, saved, after a NaN step) statistics across a restart whose
    checkpoint lacks the shadows (written before the wrapper, or by a
    version with a shadow per statistic); `sync`: run sync_shadows."""
    path = self.get_temp_dir() + "/no_shadows_%s" % sync
    values = []
    for restart in (False, True):
      with tf.Graph().as_default():
        images, train_op, moving = _legacy_train_op()
        not_shadows = [v for v in tf1.global_variables()
                       if "skip_shadow" not in v.op.name]
        sync_op = tf1_safe_train.sync_shadows()
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          if not restart:
            values.append(sess.run(list(moving)))
            sess.run(train_op, {images: _batch(1)})
            values.append(sess.run(list(moving)))
            tf1.train.Saver(not_shadows).save(sess, path)
            continue
          tf1.train.Saver(not_shadows).restore(sess, path)
          if sync:
            sess.run(sync_op)
          sess.run(train_op, {images: _batch(4, nan=True)})
          values.append(sess.run(list(moving)))
    return values

  def testWithoutSavedShadowsASkipWouldRestoreInitialValues(self):
    # Why the shadows must be checkpointed: restored without them, the first
    # skipped step after a restart takes the moving statistics back to their
    # initial values.
    initial, _, after_nan = self._restart_without_shadows(sync=False)
    for value, first in zip(after_nan, initial):
      self.assertTrue(np.array_equal(first, value))

  def testSyncShadowsAfterRestoringWithoutShadows(self):
    # The migration of such a checkpoint: restore what it has, then sync.
    initial, saved, after_nan = self._restart_without_shadows(sync=True)
    for value, restored, first in zip(after_nan, saved, initial):
      self.assertTrue(np.array_equal(restored, value))
      self.assertFalse(np.array_equal(first, value))

if __name__ == "__main__":
  tf.test.main()
