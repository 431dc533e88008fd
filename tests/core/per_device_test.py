"""One step over several devices' variable copies: one decision, one count.

Scripts that keep a copy of the variables per device (all-reduced gradients,
an apply per device) build the step with `apply_gradients_per_device`; two
guarded steps in one `session.run` are refused by name.
"""

import numpy as np
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import hooks
from tf1_safe_train.core import optimizer as optimizer_lib

tf1 = tf.compat.v1

_DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def _config():
  return tf1.ConfigProto(device_count={"CPU": 2})


def _per_device_model():
  """A copy of the test model per device, each fed its own input."""
  inputs, grads_and_vars, variables = [], [], []
  for i, device in enumerate(_DEVICES):
    with tf.device(device):
      x = tf1.placeholder(tf.float32, [3], name="x%d" % i)
      loss, var_list = test_util.model(x, scope="device%d" % i)
      grads = tf.gradients(loss, var_list)
    inputs.append(x)
    grads_and_vars.append(list(zip(grads, var_list)))
    variables += var_list
  return inputs, grads_and_vars, variables


def _ops_and_cond_bodies(graph):
  """The graph's ops and those of its v2 conds' branches."""
  found = []
  for op in graph.get_operations():
    found.append(op)
    if op.type in ("If", "StatelessIf"):
      for attr in ("then_branch", "else_branch"):
        body = graph._get_function(op.get_attr(attr).name).graph  # pylint: disable=protected-access
        found += _ops_and_cond_bodies(body)
  return found


class PerDeviceStepTest(tf.test.TestCase):

  def _run(self, optimizers=None, control_flow_v2=True):
    with tf.Graph().as_default(), test_util.tf_config(control_flow_v2):
      inputs, grads_and_vars, variables = _per_device_model()
      global_step = tf1.train.get_or_create_global_step()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.MomentumOptimizer(0.1, momentum=0.9))
      made = optimizers() if optimizers else None
      train_op = opt.apply_gradients_per_device(grads_and_vars, global_step,
                                                optimizers=made)
      report = opt.report_fetches(train_op)
      slots = [opt.get_slot(v, "momentum") for v in variables]
      if made:
        slots = [o.get_slot(v, "momentum") for o in made for v in variables
                 if o.get_slot(v, "momentum") is not None]
      state = variables + slots
      counters = counters_lib.skip_counters()
      with self.session(config=_config()) as sess:
        sess.run(tf1.global_variables_initializer())
        good = {x: test_util.GOOD_X for x in inputs}
        sess.run(train_op, good)
        before = sess.run(state)
        poisoned = {inputs[0]: test_util.GOOD_X2, inputs[1]: test_util.NAN_X}
        _, values = sess.run([train_op, report], poisoned)
        after = sess.run(state)
        line = opt.describe_skip(values)
        c = sess.run(counters)
        step = sess.run(global_step)
        # After a skip, a good step moves every copy again.
        sess.run(train_op, good)
        moved = sess.run(state)
    return before, after, moved, c, step, line, tf1.get_default_graph()

  def testOneDecisionAndOneCountPerStep(self):
    before, after, moved, counters, step, line, _ = self._run()
    for b, a in zip(before, after):
      # Device 0's gradients were finite: it did not apply either.
      self.assertAllEqual(b, a)
    self.assertFalse(all(np.array_equal(a, m) for a, m in zip(after, moved)))
    self.assertEqual((counters.applied_steps, counters.skipped_steps,
                      counters.consecutive_skips), (1, 1, 1))
    self.assertEqual(step, 2)
    self.assertEqual(
        line, "skipped step 1: non-finite gradients in tower 1 "
        "(/device:CPU:1); variables: device1/w, device1/b")

  def testOneOptimizerInstancePerDevice(self):
    make = lambda: [tf1.train.MomentumOptimizer(0.1, momentum=0.9)
                    for _ in _DEVICES]
    before, after, _, counters, _, _, _ = self._run(optimizers=make)
    self.assertLen(before, 8)  # 4 variables and their momentum slots
    for b, a in zip(before, after):
      self.assertAllEqual(b, a)
    self.assertEqual(counters.applied_steps, 1)
    self.assertEqual(counters.skipped_steps, 1)

  def testEachUpdateIsPlacedOnItsDevice(self):
    for v2 in (True, False):
      with self.subTest(control_flow_v2=v2), tf.Graph().as_default():
        with test_util.tf_config(control_flow_v2=v2):
          _, grads_and_vars, _ = _per_device_model()
          opt = optimizer_lib.SkipNonFiniteOptimizer(
              tf1.train.GradientDescentOptimizer(0.1))
          opt.apply_gradients_per_device(grads_and_vars)
        updates = [op for op in _ops_and_cond_bodies(tf1.get_default_graph())
                   if op.type == "ResourceApplyGradientDescent"]
        self.assertLen(updates, 4)
        for op in updates:
          # In a v2 cond the variable comes in as a branch input: its name
          # says which copy it is.
          device = "CPU:1" if "device1" in op.inputs[0].name else "CPU:0"
          self.assertIn(device, op.device)

  def testOptimizersMustMatchTheDevices(self):
    with tf.Graph().as_default():
      _, grads_and_vars, _ = _per_device_model()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      with self.assertRaisesRegex(ValueError, "one tf.compat.v1.train."
                                  "Optimizer per device"):
        opt.apply_gradients_per_device(
            grads_and_vars,
            optimizers=[tf1.train.GradientDescentOptimizer(0.1)])


class ReportDevicesTest(tf.test.TestCase):
  """The report's devices are the copies' (variables'), not the gradients'."""

  def _line(self, groups_fn):
    with tf.Graph().as_default():
      inputs, grads_and_vars, _ = _per_device_model()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.apply_gradients_per_device(groups_fn(grads_and_vars))
      report = opt.report_fetches(train_op)
      with self.session(config=_config()) as sess:
        sess.run(tf1.global_variables_initializer())
        _, values = sess.run([train_op, report], {
            inputs[0]: test_util.GOOD_X, inputs[1]: test_util.NAN_X})
    return opt.describe_skip(values)

  def testAllReducedOnDeviceZeroNamesEachCopysDevice(self):
    def all_reduced(grads_and_vars):
      # A naive all-reduce: summed on device 0, each copy applies the sum.
      with tf.device(_DEVICES[0]):
        sums = [tf.add_n([g0, g1]) for (g0, _), (g1, _) in
                zip(*grads_and_vars)]
      return [[(s, v) for s, (_, v) in zip(sums, group)]
              for group in grads_and_vars]
    self.assertEqual(
        self._line(all_reduced),
        "skipped step 0: non-finite gradients in towers 0 (/device:CPU:0), "
        "1 (/device:CPU:1); variables: device0/w, device0/b, device1/w, "
        "device1/b")

  def testOneAveragedGroupNamesNoTower(self):
    # Parameter-server style: every tower's gradients averaged onto one copy
    # (device 0's); which tower was non-finite is not known here.
    def averaged(grads_and_vars):
      with tf.device(_DEVICES[0]):
        return [[(tf.add_n([g0, g1]) / 2.0, v0) for (g0, v0), (g1, _) in
                 zip(*grads_and_vars)]]
    self.assertEqual(self._line(averaged),
                     "skipped step 0: non-finite gradients; variables: "
                     "device0/w, device0/b")


class TwoStepsInOneRunTest(tf.test.TestCase):

  def _two_calls(self):
    """The legacy idiom: one apply_gradients per device, grouped."""
    inputs, grads_and_vars, _ = _per_device_model()
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.GradientDescentOptimizer(0.1))
    ops = [opt.apply_gradients(gv) for gv in grads_and_vars]
    return inputs, opt, tf.group(*ops)

  def testSecondCallWarnsWhenBuilt(self):
    with tf.Graph().as_default():
      with self.assertLogs(level="WARNING") as logs:
        self._two_calls()
      self.assertTrue(any("apply_gradients called again" in line and
                          "apply_gradients_per_device" in line
                          for line in logs.output), logs.output)

  def testCheckNamesBothDecisions(self):
    with tf.Graph().as_default():
      _, opt, train_op = self._two_calls()
      with self.assertRaisesRegex(
          ValueError, r"executes 2 guarded steps \(SkipNonFinite/decide.*, "
          r"SkipNonFinite_1/decide.*apply_gradients_per_device"):
        opt.check_train_op(train_op)

  def testReportHookRefusesTheRunBeforeItCountsTwice(self):
    with tf.Graph().as_default():
      inputs, opt, train_op = self._two_calls()
      counters = counters_lib.skip_counters()
      with tf1.train.MonitoredSession(
          hooks=[opt.report_hook()],
          session_creator=tf1.train.ChiefSessionCreator(
              config=_config())) as sess:
        with self.assertRaisesRegex(ValueError, "executes 2 guarded steps"):
          sess.run(train_op, {x: test_util.GOOD_X for x in inputs})
        self.assertEqual(sess.run_step_fn(
            lambda step_context: step_context.session.run(
                counters.applied_steps)), 0)

  def testGiveUpHookRefusesTheRunToo(self):
    with tf.Graph().as_default():
      inputs, opt, train_op = self._two_calls()
      give_up = hooks.GiveUpHook(opt.guard_result().counters.consecutive_skips,
                                 2)
      with tf1.train.MonitoredSession(
          hooks=[give_up], session_creator=tf1.train.ChiefSessionCreator(
              config=_config())) as sess:
        for _ in range(2):  # Refused every time, not only the first.
          with self.assertRaisesRegex(ValueError, "executes 2 guarded steps"):
            sess.run(train_op, {x: test_util.NAN_X for x in inputs})

  def testStepsRunBySeparateRunsAreFine(self):
    # A GAN: two optimizers' steps, each run in its own session.run.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss_d, vars_d = test_util.model(x, scope="discriminator")
      loss_g, vars_g = test_util.model(x, scope="generator")
      opt_d = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), name="D")
      opt_g = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), name="G")
      step_d = opt_d.minimize(loss_d, var_list=vars_d)
      step_g = opt_g.minimize(loss_g, var_list=vars_g)
      hooks = [opt_d.report_hook(), opt_g.report_hook()]
      with tf1.train.MonitoredSession(hooks=hooks) as sess:
        sess.run(step_d, {x: test_util.GOOD_X})
        sess.run(step_g, {x: test_util.NAN_X})
      self.assertEqual(hooks[0].reports, [])
      self.assertLen(hooks[1].reports, 1)


if __name__ == "__main__":
  tf.test.main()
