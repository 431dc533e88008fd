"""Tests for tf1_safe_train.core.optimizer.SkipNonFiniteOptimizer."""

import itertools

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib

tf1 = tf.compat.v1

# name -> (factory, slot names it must create). Non-slot accumulators (Adam's
# beta powers) are found through opt.variables().
_OPTIMIZERS = {
    "GradientDescent": (
        lambda: tf1.train.GradientDescentOptimizer(0.1), []),
    "Momentum": (
        lambda: tf1.train.MomentumOptimizer(0.1, momentum=0.9), ["momentum"]),
    "Nesterov": (
        lambda: tf1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
        ["momentum"]),
    "Adam": (lambda: tf1.train.AdamOptimizer(0.01), ["m", "v"]),
    "RMSProp": (lambda: tf1.train.RMSPropOptimizer(0.01), ["momentum", "rms"]),
    "RMSPropMomentum": (
        lambda: tf1.train.RMSPropOptimizer(0.01, momentum=0.9),
        ["momentum", "rms"]),
    "RMSPropCentered": (
        lambda: tf1.train.RMSPropOptimizer(0.01, centered=True),
        ["mg", "momentum", "rms"]),
    "Adagrad": (lambda: tf1.train.AdagradOptimizer(0.1), ["accumulator"]),
    "Adadelta": (
        lambda: tf1.train.AdadeltaOptimizer(1.0), ["accum", "accum_update"]),
    "Ftrl": (lambda: tf1.train.FtrlOptimizer(0.1), ["accum", "linear"]),
    "ProximalGradientDescent": (
        lambda: tf1.train.ProximalGradientDescentOptimizer(
            0.1, l1_regularization_strength=0.01,
            l2_regularization_strength=0.01), []),
    "ProximalAdagrad": (
        lambda: tf1.train.ProximalAdagradOptimizer(
            0.1, l1_regularization_strength=0.01,
            l2_regularization_strength=0.01), ["accumulator"]),
}
_REPRESENTATIVE = ("GradientDescent", "Momentum", "Adam", "RMSProp")
# (control flow v2, resource variables); the default is (True, True).
_CONFIGS = {
    "CondV1": (False, True),
    "RefVariables": (True, False),
    "CondV1RefVariables": (False, False),
}

def _assert_bit_identical(test, expected, actual):
  test.assertEqual(sorted(expected), sorted(actual))
  test.assertNotEmpty(expected)
  for name in expected:
    test.assertTrue(
        np.array_equal(expected[name], actual[name]),
        "%s: %r != %r" % (name, expected[name], actual[name]))


def _optimizer_variables(opt, var_list):
  """Slots of `var_list` and non-slot variables of `opt`, by name."""
  found = {}
  for var in var_list:
    for slot_name in opt.get_slot_names():
      slot = opt.get_slot(var, slot_name)
      if slot is not None:
        found[slot.op.name] = slot
  # The wrapped optimizer's: the wrapper's variables() adds its counters.
  for var in getattr(opt, "wrapped_optimizer", opt).variables():
    found[var.op.name] = var
  return found


class _SkipAxesMixin(object):
  """The two claims checked for every optimizer and configuration, in one
  graph and session: a NaN step changes nothing, and applied steps equal
  the unwrapped optimizer's (an unwrapped copy of the model beside it gets
  the same finite batches; the wrapped one also the NaN batch between)."""

  def _checkSkipsAndAppliesLikeUnwrapped(self, opt_name):
    make, slot_names = _OPTIMIZERS[opt_name]
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, var_list = test_util.model(x)
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(make())
      # Before the unwrapped copy exists: minimize's default var_list.
      train_op = opt.minimize(loss, global_step=global_step)
      counters = counters_lib.skip_counters()
      exclude = list(counters) + [global_step]
      self.assertEqual(sorted(slot_names), sorted(opt.get_slot_names()))
      opt_vars = _optimizer_variables(opt, var_list)
      self.assertLen(opt_vars, len(slot_names) * len(var_list) + (
          2 if opt_name == "Adam" else 0))
      plain_loss, plain_vars = test_util.model(x, "plain")
      plain_opt = make()
      plain_op = plain_opt.minimize(plain_loss, var_list=plain_vars)
      guarded_all = var_list + sorted(opt_vars.values(),
                                      key=lambda v: v.op.name)
      plain_all = plain_vars + sorted(
          _optimizer_variables(plain_opt, plain_vars).values(),
          key=lambda v: v.op.name)
      self.assertLen(guarded_all, len(plain_all))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = test_util.snapshot(sess, exclude)
        sess.run(train_op, {x: test_util.GOOD_X})
        sess.run(plain_op, {x: test_util.GOOD_X})
        after_good = test_util.snapshot(sess, exclude)
        self.assertEqual([1, 0, 0, 1], sess.run(exclude))
        # Every model and optimizer variable is in the snapshot, and the good
        # step moved the model.
        for name in [v.op.name for v in var_list] + sorted(opt_vars):
          self.assertIn(name, after_good)
        for var in var_list:
          self.assertTrue(np.isfinite(after_good[var.op.name]).all())
          self.assertFalse(np.array_equal(initial[var.op.name],
                                          after_good[var.op.name]))
        for name in opt_vars:
          self.assertTrue(np.isfinite(after_good[name]).all(), name)

        sess.run(train_op, {x: test_util.NAN_X})
        after_nan = test_util.snapshot(sess, exclude)
        _assert_bit_identical(self, after_good, after_nan)
        self.assertEqual([1, 1, 1, 2], sess.run(exclude))

        sess.run(train_op, {x: test_util.GOOD_X2})
        self.assertEqual([2, 1, 0, 3], sess.run(exclude))
        for var in var_list:
          value = sess.run(var)
          self.assertTrue(np.isfinite(value).all(), var.op.name)
          self.assertFalse(np.array_equal(after_nan[var.op.name], value))

        # Applied steps as unwrapped: three finite batches each.
        sess.run(plain_op, {x: test_util.GOOD_X2})
        sess.run(train_op, {x: test_util.GOOD_X})
        sess.run(plain_op, {x: test_util.GOOD_X})
        guarded_values, plain_values = sess.run([guarded_all, plain_all])
      self.assertFalse(np.array_equal(initial[var_list[0].op.name],
                                      guarded_values[0]))
      for var, guarded, plain in zip(guarded_all, guarded_values, plain_values):
        self.assertTrue(np.array_equal(plain, guarded),
                        "%s: %r != %r" % (var.op.name, guarded, plain))


class EveryOptimizerTest(tf.test.TestCase, parameterized.TestCase,
                         _SkipAxesMixin):
  """All optimizers with the default configuration (cond v2, resources)."""

  @parameterized.named_parameters(*[(n, n) for n in sorted(_OPTIMIZERS)])
  def testSkipsWhenGradHasNanAppliesWhenAllFiniteLikeUnwrapped(self,
                                                               opt_name):
    self._checkSkipsAndAppliesLikeUnwrapped(opt_name)

  @parameterized.named_parameters(*[(n, n) for n in sorted(_OPTIMIZERS)])
  def testVariableNamesMatchUnwrapped(self, opt_name):
    # Drop-in: a checkpoint of an unwrapped run has the same names (the
    # wrapper only adds its counters).
    make, _ = _OPTIMIZERS[opt_name]
    names = []
    for wrap in (False, True):
      with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3])
        loss, _ = test_util.model(x)
        global_step = tf1.train.get_or_create_global_step()
        opt = make()
        if wrap:
          opt = optimizer_lib.SkipNonFiniteOptimizer(opt)
        with tf.name_scope("train"):
          opt.minimize(loss, global_step=global_step)
        names.append(sorted(v.op.name for v in tf1.global_variables()))
    self.assertEqual(
        sorted(names[0] + ["applied_steps", "consecutive_skips",
                           "skipped_steps"]), names[1])


class OtherConfigsTest(tf.test.TestCase, parameterized.TestCase,
                       _SkipAxesMixin):
  """Representative optimizers under cond v1 and/or ref variables."""

  @parameterized.named_parameters(*[
      ("%s%s" % (opt, cfg), opt, cfg)
      for opt, cfg in itertools.product(_REPRESENTATIVE, sorted(_CONFIGS))])
  def testSkipsWhenGradHasNanAppliesWhenAllFiniteLikeUnwrapped(self, opt_name,
                                                               config):
    with test_util.tf_config(*_CONFIGS[config]):
      self._checkSkipsAndAppliesLikeUnwrapped(opt_name)

  def testConfigIsInEffect(self):
    # The configs above really build ref variables and v1 conds.
    configs = dict(_CONFIGS, Default=(True, True))
    for config in sorted(configs):
      control_flow_v2, resource_variables = configs[config]
      with test_util.tf_config(control_flow_v2, resource_variables):
        with tf.Graph().as_default() as graph:
          x = tf1.placeholder(tf.float32, [3])
          loss, var_list = test_util.model(x)
          optimizer_lib.SkipNonFiniteOptimizer(
              tf1.train.MomentumOptimizer(0.1, 0.9)).minimize(loss)
          op_types = {op.type for op in graph.get_operations()}
      self.assertEqual(resource_variables, hasattr(var_list[0], "handle"),
                       config)
      # v1 conds are Switch/Merge, v2 conds an If op; ref variables always
      # get a v1 cond (a v2 branch function cannot capture them).
      uses_cond_v1 = not (control_flow_v2 and resource_variables)
      self.assertEqual(uses_cond_v1, "Switch" in op_types, config)
      self.assertEqual(not uses_cond_v1, "If" in op_types, config)
    self.assertTrue(tf1.control_flow_v2_enabled())
    self.assertTrue(tf1.resource_variables_enabled())


class WrapperApiTest(tf.test.TestCase):

  def testIsATf1Optimizer(self):
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.GradientDescentOptimizer(0.1))
    self.assertIsInstance(opt, tf1.train.Optimizer)

  def testHasNoBaseClassOfTheProjectItsPartsAreOwned(self):
    # Composition, not mixins sharing private state: its one base is
    # tf.compat.v1's Optimizer, and its parts are objects it holds.
    wrapper = optimizer_lib.SkipNonFiniteOptimizer
    self.assertEqual((tf1.train.Optimizer,), wrapper.__bases__)
    self.assertEqual([], [c.__module__ + "." + c.__name__
                          for c in wrapper.__mro__[1:]
                          if c.__module__.startswith("tf1_safe_train")])

  def testWrappingANonOptimizerRaisesTypeError(self):
    for not_an_optimizer in ("adam", None, object(),
                             tf.keras.optimizers.SGD(0.1)):
      with self.assertRaisesRegex(TypeError, "tf.compat.v1.train.Optimizer"):
        optimizer_lib.SkipNonFiniteOptimizer(not_an_optimizer)

  def testMinimizeWithGlobalStepAndVarList(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, (w, b) = test_util.model(x)
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.5))
      train_op = opt.minimize(loss, global_step=global_step, var_list=[w])
      self.assertEqual(["model/w"], opt.guard_result().variable_names)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        w0, b0 = sess.run([w, b])
        sess.run(train_op, {x: test_util.GOOD_X})
        w1, b1 = sess.run([w, b])
        # d/dw sum((w*x - 1)^2) = 2 x (w x - 1).
        self.assertAllClose(
            w0 - 0.5 * 2 * test_util.GOOD_X * (w0 * test_util.GOOD_X - 1), w1)
        self.assertTrue(np.array_equal(b0, b1))
        self.assertEqual(1, sess.run(global_step))
        sess.run(train_op, {x: test_util.NAN_X})
        self.assertTrue(np.array_equal(w1, sess.run(w)))
        self.assertEqual(2, sess.run(global_step))

  def testIncrementGlobalStepOnSkipFalse(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1),
          increment_global_step_on_skip=False)
      train_op = opt.minimize(loss, global_step=global_step)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        steps = []
        for batch in (test_util.GOOD_X, test_util.NAN_X, test_util.NAN_X,
                      test_util.GOOD_X2):
          sess.run(train_op, {x: batch})
          steps.append(sess.run(global_step))
        self.assertEqual([1, 1, 1, 2], steps)

  def testComputeGradientsAndSlotsDelegate(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, (w, b) = test_util.model(x)
      inner = tf1.train.AdamOptimizer(0.01)
      opt = optimizer_lib.SkipNonFiniteOptimizer(inner)
      self.assertIs(inner, opt.wrapped_optimizer)
      grads_and_vars = opt.compute_gradients(loss)
      self.assertEqual([w, b], [v for _, v in grads_and_vars])
      opt.apply_gradients(grads_and_vars)
      self.assertEqual(["m", "v"], sorted(opt.get_slot_names()))
      for var in (w, b):
        for slot_name in ("m", "v"):
          slot = opt.get_slot(var, slot_name)
          self.assertIsNotNone(slot)
          self.assertIs(inner.get_slot(var, slot_name), slot)
      self.assertNotEmpty(inner.variables())
      # The wrapped optimizer's, then the wrapper's own (what Keras 2
      # initializes: tests/core/keras_route_test.py).
      self.assertEqual(inner.variables(),
                       opt.variables()[:len(inner.variables())])
      self.assertEqual(
          ["applied_steps", "skipped_steps", "consecutive_skips"],
          [v.op.name for v in opt.variables()[len(inner.variables()):]])
      # Named as the unwrapped optimizer names them, not inside the cond.
      self.assertEqual(
          ["beta1_power", "beta2_power", "model/b/Adam", "model/b/Adam_1",
           "model/w/Adam", "model/w/Adam_1"],
          sorted(v.op.name for v in inner.variables()))

  def testRestoresCheckpointOfUnwrappedRun(self):
    path = self.get_temp_dir() + "/unwrapped"
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      train_op = tf1.train.AdamOptimizer(0.01).minimize(loss)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})
        saved = test_util.snapshot(sess)
        tf1.train.Saver().save(sess, path)
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      train_op = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.AdamOptimizer(0.01)).minimize(loss)
      counters = list(counters_lib.skip_counters())
      old_variables = [v for v in tf1.global_variables()
                       if v.op.name not in {c.op.name for c in counters}]
      with tf1.Session() as sess:
        sess.run(tf1.variables_initializer(counters))
        tf1.train.Saver(old_variables).restore(sess, path)
        _assert_bit_identical(self, saved, test_util.snapshot(sess, counters))
        sess.run(train_op, {x: test_util.NAN_X})
        _assert_bit_identical(self, saved, test_util.snapshot(sess, counters))

  def testUpdateOpItCannotAnalyseIsRefusedAtGraphBuild(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      stat = tf1.get_variable("stat", initializer=tf.constant([1.0]),
                              trainable=False)
      # A moving statistic that a loop writes: it cannot be rolled back.
      def _body(i):
        with tf1.control_dependencies([tf1.assign_sub(stat, [0.1])]):
          return i + 1
      loop = tf.while_loop(lambda i: i < 2, _body, [tf.constant(0)])[0]
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, loop)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        with self.assertRaisesRegex(
            ValueError, r"^update op while \(While\) may write stat;[^\n]*$"):
          opt.minimize(loss)

  def testAppliedIsTrueOnFiniteStepAndFalseOnNanStep(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.MomentumOptimizer(0.1, 0.9))
      with self.assertRaisesRegex(ValueError, "has not been called"):
        opt.applied()
      train_op = opt.minimize(loss)
      applied = opt.applied()
      self.assertEqual(tf.bool, applied.dtype)
      self.assertIn(opt.guard_result(),
                    tf1.get_collection(optimizer_lib.GUARD_RESULTS))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        self.assertTrue(sess.run([train_op, applied], {x: test_util.GOOD_X})[1])
        self.assertFalse(sess.run([train_op, applied], {x: test_util.NAN_X})[1])
        self.assertTrue(
            sess.run([train_op, applied], {x: test_util.GOOD_X2})[1])


class SparseGradientTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("Adam", lambda: tf1.train.AdamOptimizer(0.1), "ResourceScatterAdd"),
      ("Adagrad", lambda: tf1.train.AdagradOptimizer(0.1),
       "ResourceSparseApplyAdagrad"))
  def testSkipsWhenEmbeddingGradHasNan(self, make, sparse_op_type):
    with tf.Graph().as_default() as graph:
      table = tf1.get_variable(
          "table", initializer=tf.constant(
              [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8], [0.9, 1.0]]))
      ids = tf.constant([1, 3, 1])
      scale = tf1.placeholder(tf.float32, [])
      loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * scale)
      opt = optimizer_lib.SkipNonFiniteOptimizer(make())
      grads_and_vars = opt.compute_gradients(loss)
      self.assertIsInstance(grads_and_vars[0][0], tf.IndexedSlices)
      train_op = opt.apply_gradients(grads_and_vars)
      # The wrapped optimizer took its sparse path (inside the cond branch).
      op_types = {node.op for f in graph.as_graph_def().library.function
                  for node in f.node_def}
      self.assertIn(sparse_op_type, op_types)
      counters = list(counters_lib.skip_counters())
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        initial = test_util.snapshot(sess, counters)
        sess.run(train_op, {scale: 1.5})
        after_good = test_util.snapshot(sess, counters)
        self.assertFalse(np.array_equal(initial["table"], after_good["table"]))
        # Rows 0, 2 and 4 have no gradient: the sparse update leaves them.
        self.assertTrue(np.array_equal(initial["table"][[0, 2, 4]],
                                       after_good["table"][[0, 2, 4]]))
        sess.run(train_op, {scale: test_util.NAN})
        _assert_bit_identical(self, after_good,
                              test_util.snapshot(sess, counters))
        self.assertEqual([1, 1, 1], sess.run(counters))


# dtype name -> (dtype, a finite gradient value whose double is not finite).
_OVERFLOWING = {"Float32": (tf.float32, 2e38), "Float16": (tf.float16, 4e4)}
# (Adagrad's accumulator overflows on one such value alone: not this case.)
_SPARSE_OPTIMIZERS = {
    "GradientDescent": lambda: tf1.train.GradientDescentOptimizer(1.0),
    "Momentum": lambda: tf1.train.MomentumOptimizer(1.0, momentum=0.9),
}


def _lookup_twice(table, how):
  """Row 1 of `table`, looked up twice: a gradient with index 1 twice."""
  if how == "EmbeddingLookup":
    return tf.nn.embedding_lookup(table, [1, 1, 2])
  return tf.concat([tf.gather(table, [1]), tf.gather(table, [1, 2])], 0)


class RepeatedSparseIndicesTest(tf.test.TestCase, parameterized.TestCase):

  def _build(self, dtype, make, how, wrapped):
    table = tf1.get_variable("table", dtype=dtype, initializer=tf.constant(
        [[0.5, -0.5], [0.25, 1.0], [-1.0, 0.75]], dtype))
    scale = tf1.placeholder(dtype, [])
    loss = tf.reduce_sum(_lookup_twice(table, how) * scale)
    opt = make()
    if wrapped:
      opt = optimizer_lib.SkipNonFiniteOptimizer(opt)
    grads_and_vars = opt.compute_gradients(loss, [table])
    grad = grads_and_vars[0][0]
    self.assertIsInstance(grad, tf.IndexedSlices)
    return table, scale, opt, opt.apply_gradients(grads_and_vars)

  @parameterized.named_parameters(
      (dtype + name + how, dtype, name, how)
      for dtype in sorted(_OVERFLOWING) for name in sorted(_SPARSE_OPTIMIZERS)
      for how in ("EmbeddingLookup", "GatherTwice"))
  def testFiniteValuesWhoseSumOverflowsSkip(self, dtype_name, opt_name, how):
    dtype, big = _OVERFLOWING[dtype_name]
    for wrapped in (False, True):
      with tf.Graph().as_default():
        table, scale, opt, train_op = self._build(
            dtype, _SPARSE_OPTIMIZERS[opt_name], how, wrapped)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          counters = list(counters_lib.skip_counters()) if wrapped else []
          sess.run(train_op, {scale: 1.0})
          before = test_util.snapshot(sess, counters)
          fetches = [train_op] + ([opt.applied()] if wrapped else [])
          applied = sess.run(fetches, {scale: big})[1:]
          after = test_util.snapshot(sess, counters)
          if not wrapped:
            # What the wrapper prevents: finite gradients, a non-finite sum.
            self.assertFalse(np.isfinite(np.concatenate(
                [v.ravel() for v in after.values()])).all())
            continue
          self.assertEqual([False], applied)
          _assert_bit_identical(self, before, after)

  @parameterized.named_parameters(
      (name, name) for name in ("GradientDescent", "Momentum", "Adagrad",
                                "Adam"))
  def testUniqueIndicesApplyLikeUnwrapped(self, opt_name):
    make = _OPTIMIZERS[opt_name][0]
    states = []
    for wrapped in (False, True):
      with tf.Graph().as_default():
        table = tf1.get_variable("table", initializer=tf.constant(
            [[0.5, -0.5], [0.25, 1.0], [-1.0, 0.75]]))
        scale = tf1.placeholder(tf.float32, [])
        loss = tf.reduce_sum(
            tf.nn.embedding_lookup(table, [2, 0]) * scale * [1.5, -0.3])
        opt = make()
        if wrapped:
          opt = optimizer_lib.SkipNonFiniteOptimizer(opt)
        train_op = opt.minimize(loss)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          for value in (1.0, 0.7, -2.1):
            sess.run(train_op, {scale: value})
          states.append(test_util.snapshot(
              sess, list(counters_lib.skip_counters()) if wrapped else []))
    _assert_bit_identical(self, states[0], states[1])
    self.assertIn("table", states[1])


if __name__ == "__main__":
  tf.test.main()
