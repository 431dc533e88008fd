"""The wrapper's skip report, and the check of what a train op writes."""

import numpy as np
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import optimizer as optimizer_lib

tf1 = tf.compat.v1

_DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def _towers():
  """Two towers sharing the variables, averaged as legacy scripts do."""
  inputs, tower_grads = [], []
  for i, device in enumerate(_DEVICES):
    with tf.device(device):
      x = tf1.placeholder(tf.float32, [3], name="x%d" % i)
      with tf1.variable_scope("", reuse=tf1.AUTO_REUSE):
        loss, var_list = test_util.model(x)
      tower_grads.append(list(zip(tf.gradients(loss, var_list), var_list)))
    inputs.append(x)
  average = [(tf.add_n([tower_grads[0][j][0], tower_grads[1][j][0]]) / 2.0,
              tower_grads[0][j][1]) for j in range(len(var_list))]
  return inputs, tower_grads, average


class SkipReportTest(tf.test.TestCase):

  def testPlainLoopReportNamesTheTowerAndItsDevice(self):
    with tf.Graph().as_default():
      inputs, tower_grads, average = _towers()
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.apply_gradients(average, global_step,
                                     tower_grads_and_vars=tower_grads)
      report = opt.report_fetches(train_op)
      lines = []
      config = tf1.ConfigProto(device_count={"CPU": 2})
      with self.session(config=config) as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(3):
          feed = {x: test_util.GOOD_X for x in inputs}
          if step == 1:
            feed[inputs[1]] = test_util.NAN_X
          _, values = sess.run([train_op, report], feed)
          lines.append(opt.describe_skip(values))
    self.assertEqual(lines, [
        None, "skipped step 1: non-finite gradients in tower 1 "
        "(/device:CPU:1); variables: model/w, model/b", None])

  def testTowersWithoutDevices(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      with tf1.variable_scope("", reuse=tf1.AUTO_REUSE):
        towers = [list(zip(tf.gradients(loss, var_list), var_list))
                  for loss, var_list in [test_util.model(x * (i + 1.0))
                                         for i in range(2)]]
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.apply_gradients(towers[0], tower_grads_and_vars=towers)
      report = opt.report_fetches()
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        _, values = sess.run([train_op, report], {x: test_util.NAN_X})
    self.assertEqual(
        opt.describe_skip(values), "skipped step 0: non-finite gradients in "
        "towers 0, 1; variables: model/w, model/b")

  def testHookReportsWithoutTowersOrGlobalStep(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.minimize(loss)
      hook = opt.report_hook()
      with tf1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        for batch in (test_util.GOOD_X, test_util.NAN_X, test_util.NAN_X):
          sess.run(train_op, {x: batch})
    self.assertEqual(hook.reports, [
        "skipped step 1: non-finite gradients; variables: model/w, model/b",
        "skipped step 2: non-finite gradients; variables: model/w, model/b"])

  def testIncrementGlobalStepOnlyOnAppliedSteps(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1),
          increment_global_step_on_skip=False)
      train_op = opt.minimize(loss, global_step=global_step)
      hook = opt.report_hook()
      with tf1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        for batch in (test_util.GOOD_X, test_util.NAN_X, test_util.NAN_X):
          sess.run(train_op, {x: batch})
    self.assertEqual([r.split(":")[0] for r in hook.reports],
                     ["skipped step 1", "skipped step 1"])


class ClippedGradientsTest(tf.test.TestCase):
  """`tf.clip_by_global_norm` before `apply_gradients` (BERT's structure)."""

  def _line(self, route, x_value):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      w0 = tf1.get_variable("w0", initializer=tf.constant([0.25, -0.5, 1.0]))
      w1 = tf1.get_variable("w1", initializer=tf.constant(0.125))
      # Only w0's gradient depends on x.
      loss = tf.reduce_sum(w0 * x) + tf.square(w1)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      if route == "compute_gradients":
        grads, tvars = zip(*opt.compute_gradients(loss))
      else:
        tvars = [w0, w1]
        grads = tf.gradients(loss, tvars)
      clipped, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
      train_op = opt.apply_gradients(zip(clipped, tvars))
      report = opt.report_fetches(train_op)
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        _, values = sess.run([train_op, report],
                             {x: np.array(x_value, np.float32)})
    return opt.describe_skip(values)

  def testNamesTheGradientThatWasNonFiniteBeforeClipping(self):
    for route in ("compute_gradients", "tf.gradients"):
      with self.subTest(route):
        self.assertEqual(
            self._line(route, [0.5, float("nan"), 2.0]),
            "skipped step 0: non-finite gradients; variables: w0; spread to "
            "w1 after the gradients were computed (e.g. by "
            "tf.clip_by_global_norm)")

  def testSaysWhenClippingItselfOverflowed(self):
    # Finite gradients whose global norm overflows float32: every clipped
    # gradient is NaN.
    self.assertEqual(
        self._line("tf.gradients", [1e30, 1e30, 1e30]),
        "skipped step 0: non-finite gradients; variables: w0, w1 (finite as "
        "computed, made non-finite after: e.g. tf.clip_by_global_norm of a "
        "norm that overflows)")


class WriteCheckTest(tf.test.TestCase):

  def _ema_step(self, protect, strict=False, **config):
    with test_util.tf_config(**config):
      x = tf1.placeholder(tf.float32, [3])
      loss, var_list = test_util.model(x)
      moving = tf1.get_variable("moving", initializer=tf.zeros([3]),
                                trainable=False)
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                            tf1.assign_sub(moving, (moving - x) * 0.1))
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.MomentumOptimizer(0.1, momentum=0.9), strict=strict,
          loss_scale="dynamic")
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        apply_op = opt.minimize(loss, global_step=global_step)
      ema = tf1.train.ExponentialMovingAverage(0.9)
      train_op = tf.group(apply_op, ema.apply(var_list))
      if protect:
        train_op = opt.protect(train_op)
      return x, opt, train_op

  def testEmaWithoutProtectIsNamed(self):
    for name, config in [("v2", {}), ("v1", {"control_flow_v2": False}),
                         ("ref", {"control_flow_v2": False,
                                  "resource_variables": False})]:
      with self.subTest(name), tf.Graph().as_default():
        _, opt, train_op = self._ema_step(protect=False, **config)
        # Inside the decision (the optimizer, its slots, the loss scale),
        # rolled back (the statistic) and counters are fine: only the EMA.
        self.assertEqual(opt.check_train_op(train_op),
                         ["model/b/ExponentialMovingAverage",
                          "model/w/ExponentialMovingAverage"])

  def testProtectedTrainOpWritesNothingOutside(self):
    for config in [{}, {"control_flow_v2": False}]:
      with self.subTest(str(config)), tf.Graph().as_default():
        _, opt, train_op = self._ema_step(protect=True, **config)
        self.assertEqual(opt.check_train_op(train_op), [])

  def testOnlyARollbackTheRunExecutesCounts(self):
    # The shadows protect() made do not help a run of the unprotected op.
    for config in [{}, {"control_flow_v2": False, "resource_variables": False}]:
      with self.subTest(str(config)), tf.Graph().as_default():
        _, opt, unprotected = self._ema_step(protect=False, **config)
        protected = opt.protect(unprotected)
        self.assertEqual(opt.check_train_op(protected), [])
        self.assertEqual(opt.check_train_op(unprotected),
                         ["model/b/ExponentialMovingAverage",
                          "model/w/ExponentialMovingAverage"])

  def testStrictRefusesTheFirstRun(self):
    with tf.Graph().as_default():
      x, opt, train_op = self._ema_step(protect=False, strict=True)
      with self.assertRaisesRegex(
          ValueError, r"writes 2 variable\(s\) outside the skip decision.*"
          r"model/b/ExponentialMovingAverage"):
        opt.check_train_op(train_op)
      with tf1.train.MonitoredTrainingSession(
          hooks=[opt.report_hook()]) as sess:
        with self.assertRaisesRegex(ValueError, "outside the skip decision"):
          sess.run(train_op, {x: test_util.GOOD_X})

  def testUpdateOpsGroupedAfterTheApplyAreNamed(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      moving = tf1.get_variable("bn/moving_mean", initializer=tf.zeros([3]),
                                trainable=False)
      update = tf1.assign_sub(moving, (moving - x) * 0.1)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), update_ops=[])
      train_op = tf.group(opt.minimize(loss), update)
      hook = opt.report_hook()
      with tf1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
        with self.assertLogs(level="WARNING") as logs:
          sess.run(train_op, {x: test_util.GOOD_X})
          sess.run(train_op, {x: test_util.GOOD_X})
      warned = [r for r in logs.output if "outside the skip decision" in r]
      self.assertLen(warned, 1)  # Once per train op, not per run.
      self.assertIn("bn/moving_mean", warned[0])

  def testWritesInsideConds(self):
    # Batch norm behind a tensor `training`: its update is a cond, v2
    # (functions, nested here) or v1 (Switch/Merge in the graph).
    for v2 in (True, False):
      with self.subTest(control_flow_v2=v2), tf.Graph().as_default():
        with test_util.tf_config(control_flow_v2=v2):
          x = tf1.placeholder(tf.float32, [3])
          training = tf1.placeholder_with_default(True, [])
          loss, _ = test_util.model(x)
          mean = tf1.get_variable("bn/moving_mean", initializer=tf.zeros([3]),
                                  trainable=False)

          def _update():
            inner = tf.cond(training, lambda: tf1.assign_sub(mean, x * 0.1),
                            lambda: tf.identity(mean))
            return tf.identity(inner)

          update = tf.cond(training, _update, lambda: tf.identity(mean))
          opt = optimizer_lib.SkipNonFiniteOptimizer(
              tf1.train.GradientDescentOptimizer(0.1), update_ops=[])
          train_op = tf.group(opt.minimize(loss), update)
          self.assertEqual(opt.check_train_op(train_op), ["bn/moving_mean"])


if __name__ == "__main__":
  tf.test.main()
