"""The trainer's hooks, each on a small graph of its own."""

import tensorflow as tf

import optimizer_test_util as test_util
from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.trainer import hooks

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


class GiveUpHookTest(tf.test.TestCase):

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
