"""The trainer's hooks, each on a small graph of its own."""

from unittest import mock

from absl import logging
import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.trainer.run import hooks

tf1 = tf.compat.v1

_NAN_STEP = 2


class StopAtStepHookTest(tf.test.TestCase):
  """A run restored at --max_steps (a rerun, or a crash after the end)."""

  def testRunsNoStepWhenRestoredAtLastStep(self):
    with tf.Graph().as_default():
      global_step = tf1.train.get_or_create_global_step()
      step = tf1.assign_add(global_step, 1)
      start_at = tf1.placeholder(tf.int64, [])
      restore = tf1.assign(global_step, start_at)
      for make_hook, start, expected_steps in (
          (lambda: hooks.StopAtStepHook(last_step=5), 5, 0),
          (lambda: hooks.StopAtStepHook(last_step=5), 7, 0),
          (lambda: hooks.StopAtStepHook(last_step=5), 3, 2),
          # The last step, not a number of steps from the restored one.
          (lambda: hooks.StopAtStepHook(5), 3, 2),
          # TensorFlow's: one step too far.
          (lambda: tf1.train.StopAtStepHook(last_step=5), 5, 1),
      ):
        hook = make_hook()
        with self.subTest(hook=type(hook).__module__, start=start):
          scaffold = tf1.train.Scaffold(
              init_fn=lambda _, session, v=start: session.run(
                  restore, {start_at: v}))
          steps = 0
          with tf1.train.MonitoredSession(
              session_creator=tf1.train.ChiefSessionCreator(scaffold=scaffold),
              hooks=[hook]) as session:
            while not session.should_stop():
              session.run(step)
              steps += 1
          self.assertEqual(steps, expected_steps)


def _train_with(make_hooks, steps, nan_steps=()):
  """Runs `steps` wrapped steps of the test model under `make_hooks(...)`.

  Args:
    make_hooks: `make_hooks(step_index, loss, counters)` -> list of hooks.
    steps: how many steps to run.
    nan_steps: the steps fed a NaN batch.
  """
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [3])
    loss, _ = test_util.model(x)
    global_step = tf1.train.get_or_create_global_step()
    step_index = tf.identity(global_step.read_value())
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.GradientDescentOptimizer(0.1))
    with tf1.control_dependencies([step_index]):
      train_op = opt.minimize(loss, global_step=global_step)
    hooks_made = make_hooks(step_index, loss, opt.guard_result().counters)
    with tf1.train.MonitoredSession(hooks=hooks_made) as sess:
      for i in range(steps):
        sess.run(train_op, {x: test_util.NAN_X if i in nan_steps
                            else test_util.GOOD_X})


class ProgressHookTest(tf.test.TestCase):

  def _lines(self, steps, clock, **kwargs):
    """The progress lines of `steps` steps, `clock` seconds after each."""
    make = lambda step_index, loss, counters: [hooks.ProgressHook(
        step_index, loss, tf.constant(0.1), counters, 8, **kwargs)]
    # The hook's own clock only (logging reads time.time too).
    with mock.patch.object(hooks, "time") as fake_time, \
        self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      fake_time.time.side_effect = clock
      _train_with(make, steps, nan_steps=(2,))
    return [r.getMessage() for r in logs.records]

  def testSaysHowFarAndTheTimeLeftAtTheRecentPace(self):
    # Steps end at t = 0, 1, ..., 5, then 3 s each: the ETA follows the
    # pace of the last intervals (5 at most), not the whole run's.
    # A line names the step's index (as a skip's line does) and counts
    # that step: step 2, fed a NaN, is in its own line's "skipped 1"
    # (issue 37, 6; the lines were one step earlier: "step 2 ... applied 2
    # skipped 0", then "step 4 ... applied 3 skipped 1").
    times = [0, 1, 2, 3, 4, 5] + [5 + 3 * i for i in range(1, 30)]
    lines = self._lines(21, iter(times), every_n_steps=2, max_steps=100)
    self.assertRegex(lines[0], r"^step 2/100  loss \S+  lr 0.1  8.0 "
                     r"examples/s  applied 2  skipped 1  ETA 0:01:37$")
    self.assertRegex(lines[1], r"^step 4/100  .*  applied 4  skipped 1  "
                     r"ETA 0:01:35$")
    # Steps 6-20 took 3 s each: the last five intervals (steps 11-20) see
    # only those (79 steps left: 3:57).
    self.assertRegex(lines[-1], r"^step 20/100  .* ETA 0:03:57$")
    self.assertLen(lines, 10)

  def testTheRunsLastStepHasALine(self):
    lines = self._lines(5, iter(range(10)), every_n_steps=2, max_steps=5)
    self.assertRegex(lines[-1], r"^step 4/5  .*  applied 4  skipped 1  "
                     r"ETA 0:00:00$")
    self.assertLen(lines, 2)

  def testOpenEndedRunSaysNoEta(self):
    lines = self._lines(4, iter(range(10)), every_n_steps=2)
    self.assertRegex(lines[0], r"^step 2  loss \S+  lr 0.1  8.0 "
                     r"examples/s  applied 2  skipped 1$")

  def testEtaFormat(self):
    self.assertEqual(
        [hooks.format_eta(s) for s in (None, 0, 40.4, 125, 3600 * 30 + 61)],
        ["-", "0:00:00", "0:00:40", "0:02:05", "30:01:01"])


class GiveUpHookTest(tf.test.TestCase):

  def _give_up_line(self, **setting):
    """The error line of a GiveUpHook(max 2) on two NaN steps."""
    make = lambda step_index, loss, counters: [core_hooks.GiveUpHook(
        counters.consecutive_skips, 2, **setting)]
    with self.assertLogs(logging.get_absl_logger(), "ERROR") as logs:
      _train_with(make, 2, nan_steps=(0, 1))
    return [r.getMessage() for r in logs.records]

  def testLineNamesTheConstructorArgumentInLibraryUse(self):
    self.assertEqual(self._give_up_line(), [
        "giving up: 2 consecutive steps skipped (GiveUpHook's "
        "max_consecutive_skips=2)"])

  def testLineNamesTheSettingItIsGiven(self):
    # The trainer's: its flag.
    self.assertEqual(
        self._give_up_line(setting="--max_consecutive_skips"),
        ["giving up: 2 consecutive steps skipped (--max_consecutive_skips=2)"])

  def testStopsAtTheSkippedStep(self):
    # The optional line of the README, with a limit of one skip.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.minimize(
          loss, global_step=tf1.train.get_or_create_global_step())
      give_up = core_hooks.GiveUpHook(
          opt.guard_result().counters.consecutive_skips, 1)
      steps = 0
      with tf1.train.MonitoredTrainingSession(
          hooks=[tf1.train.StopAtStepHook(last_step=10), give_up]) as sess:
        while not sess.should_stop():
          batch = test_util.NAN_X if steps == _NAN_STEP else test_util.GOOD_X
          sess.run(train_op, {x: batch})
          steps += 1
    self.assertTrue(give_up.gave_up)
    self.assertEqual(_NAN_STEP + 1, steps)

  def testNeverGivesUpWithZero(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      loss, _ = test_util.model(x)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1))
      train_op = opt.minimize(
          loss, global_step=tf1.train.get_or_create_global_step())
      give_up = core_hooks.GiveUpHook(
          opt.guard_result().counters.consecutive_skips, 0)
      with tf1.train.MonitoredTrainingSession(
          hooks=[tf1.train.StopAtStepHook(last_step=4), give_up]) as sess:
        while not sess.should_stop():
          sess.run(train_op, {x: test_util.NAN_X})
    self.assertFalse(give_up.gave_up)


if __name__ == "__main__":
  tf.test.main()
