"""A run that does not fetch the train op never trains, whatever the hooks.

Every hook the library offers, given tensors read after the train op (as the
docs' recipes and the trainer do), is put in one `MonitoredSession`; an
evaluation fetch must leave the weights, the counters and `global_step`
unchanged, and a training fetch must still be reported.
"""

from unittest import mock

import numpy as np
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.trainer.checkpoint import finite_state
from tf1_safe_train.trainer.run import hooks
from tf1_safe_train.trainer.run import stop_signals

tf1 = tf.compat.v1


def _every_hook(opt, global_step, loss):
  """One of each hook the library offers, all fetching after the step."""
  result = opt.guard_result()
  step_index = tf.identity(global_step.read_value())
  with tf1.control_dependencies([result.train_op]):
    global_step_after = tf.identity(global_step.read_value())
  return {
      "progress": hooks.ProgressHook(step_index, loss, tf.constant(0.1),
                                     result.counters, 1, every_n_steps=1),
      "skip_report": hooks.SkipReportHook(
          step_index, result.applied,
          tf.expand_dims(result.nonfinite_flags, 0), result.nonfinite_flags,
          result.variable_names, ["/device:CPU:0"]),
      "give_up": core_hooks.GiveUpHook(result.counters.consecutive_skips, 1),
      "stats": hooks.RunStatsHook({"global_step": global_step_after,
                                   "counters": result.counters}),
      "signal": stop_signals.StopOnSignalHook(),
      "stop_at_step": hooks.StopAtStepHook(100),
      "report": opt.report_hook(),
      "finite_state": finite_state.NonFiniteStateHook(
          finite_state.FiniteStateCheck(), step_index, result.applied,
          "a test"),
  }


class EvaluationFetchTest(tf.test.TestCase):

  def _build(self):
    x = tf1.placeholder(tf.float32, [3])
    loss, variables = test_util.model(x)
    global_step = tf1.train.get_or_create_global_step()
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.MomentumOptimizer(0.1, momentum=0.9))
    train_op = opt.minimize(loss, global_step=global_step)
    return x, loss, variables, global_step, opt, train_op

  def testEvaluationFetchTrainsNothingWithEveryHook(self):
    with tf.Graph().as_default():
      x, loss, variables, global_step, opt, train_op = self._build()
      every = _every_hook(opt, global_step, loss)
      counters = counters_lib.skip_counters()
      state = variables + [global_step, counters]
      # Read without hooks: the hooks are what is under test.
      read = lambda step_context: step_context.session.run(state)
      with tf1.train.MonitoredSession(hooks=list(every.values())) as sess:
        before = sess.run_step_fn(read)
        for _ in range(3):
          sess.run(loss, {x: test_util.GOOD_X})
        after = sess.run_step_fn(read)
        for b, a in zip(before, after):
          self.assertAllEqual(b, a)
        # A NaN evaluation batch neither trains nor counts a skip, so
        # GiveUpHook (max 1) does not stop the session either.
        sess.run(loss, {x: test_util.NAN_X})
        self.assertFalse(sess.should_stop())
        for b, a in zip(before, sess.run_step_fn(read)):
          self.assertAllEqual(b, a)
        self.assertIsNone(every["stats"].latest)
        self.assertEqual(every["stats"].steps_run, 0)

        # A training fetch still trains and is reported by each hook.
        sess.run(train_op, {x: test_util.GOOD_X})
        self.assertEqual(every["stats"].latest["global_step"], 1)
        self.assertEqual(every["stats"].latest["counters"].applied_steps, 1)
        # The skip report hook's own log lines (not the wrapper's report).
        with mock.patch.object(hooks, "logging", wraps=hooks.logging) as log:
          sess.run(train_op, {x: test_util.NAN_X})
        skip_reports = [c.args[0] % c.args[1:]
                        for c in log.warning.call_args_list]
        self.assertLen(skip_reports, 1)
        self.assertStartsWith(skip_reports[0], "skipped step ")
        self.assertLen(every["report"].reports, 1)
        self.assertTrue(every["give_up"].gave_up)
        self.assertTrue(sess.should_stop())

  def testTrainOpGroupedWithMoreStillReports(self):
    with tf.Graph().as_default():
      x, loss, _, global_step, opt, train_op = self._build()
      every = _every_hook(opt, global_step, loss)
      with tf1.train.MonitoredSession(hooks=list(every.values())) as sess:
        # Fetched among others, and by name: the hooks still see the step.
        sess.run({"loss": loss, "train": train_op.name},
                 {x: test_util.GOOD_X})
        self.assertEqual(every["stats"].steps_run, 1)


class FetchGateTest(tf.test.TestCase):

  def testRefWritesAndStatefulOpsHaveEffects(self):
    with tf.Graph().as_default():
      with test_util.tf_config(resource_variables=False):
        ref = tf1.Variable(1.0)
      res = tf1.get_variable("res", initializer=1.0, use_resource=True)
      self.assertTrue(fetch_gate.has_effect(tf1.assign_add(ref, 1.0).op))
      self.assertTrue(fetch_gate.has_effect(res.assign_add(1.0).op))
      self.assertTrue(fetch_gate.has_effect(tf.random.uniform([1]).op))
      self.assertFalse(fetch_gate.has_effect(res.read_value().op))
      self.assertFalse(fetch_gate.has_effect(tf.identity(ref).op))

  def testFedTensorsCutTheWalk(self):
    with tf.Graph().as_default():
      v = tf1.get_variable("v", initializer=1.0, use_resource=True)
      with tf1.control_dependencies([v.assign_add(1.0)]):
        bumped = tf.identity(v.read_value())
      doubled = bumped * 2.0
      walked = fetch_gate.ancestors([doubled.op])
      self.assertIn(bumped.op, walked)
      cut = fetch_gate.ancestors([doubled.op], frozenset([bumped.name]))
      self.assertNotIn(bumped.op, cut)


if __name__ == "__main__":
  tf.test.main()
