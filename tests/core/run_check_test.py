"""The first-run check (`core/run_check.py`), whatever runs the train op.

The README's one line, `opt = SkipNonFiniteOptimizer(opt)`, with an
`ExponentialMovingAverage` grouped into the train op and no report API
called: the first run of the step says which variables a skip would still
change and the line to add, whether a plain `Session.run`, a
`MonitoredTrainingSession`, a `Supervisor`, `make_callable` or the callable
path Keras uses runs it; once per distinct set of fetches; never for a run
that executes no guarded step; never with `check_runs=False`; and it adds
nothing a step executes.
"""

import re
from unittest import mock

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2  # pylint: disable=g-direct-tensorflow-import

from bench import executed_ops
from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import run_check
from tf1_safe_train.core import write_check

tf1 = tf.compat.v1

_TOLD = "outside the skip decision"


def _ema_step(protect=False, **kwargs):
  """The one line, an EMA grouped after the apply: (x, opt, train_op, loss)."""
  x = tf1.placeholder(tf.float32, [3], name="x")
  loss, var_list = test_util.model(x)
  global_step = tf1.train.get_or_create_global_step()
  opt = optimizer_lib.SkipNonFiniteOptimizer(
      tf1.train.MomentumOptimizer(0.1, momentum=0.9), **kwargs)
  apply_op = opt.minimize(loss, global_step=global_step)
  ema = tf1.train.ExponentialMovingAverage(0.9)
  train_op = tf.group(apply_op, ema.apply(var_list), name="train_op")
  if protect:
    train_op = opt.protect(train_op)
  return x, opt, train_op, loss


def _told(logs):
  return [line for line in logs.output if _TOLD in line]


class RunCheckTest(tf.test.TestCase):

  def _assert_told_once(self, logs):
    told = _told(logs)
    self.assertLen(told, 1, logs.output)
    self.assertIn("model/b/ExponentialMovingAverage, "
                  "model/w/ExponentialMovingAverage", told[0])
    self.assertIn("`train_op = opt.protect(train_op)`", told[0])
    self.assertIn("('train_op' here)", told[0])  # What runs the step.
    self.assertIn("check_runs=False", told[0])  # How to turn it off.

  def testPlainSessionRunIsToldOnceAtTheFirstRun(self):
    with tf.Graph().as_default():
      x, _, train_op, _ = _ema_step()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        with self.assertLogs(level="WARNING") as logs:
          for _ in range(3):
            sess.run(train_op, {x: test_util.GOOD_X})
      self._assert_told_once(logs)

  def testMonitoredTrainingSessionWithoutHooksIsTold(self):
    with tf.Graph().as_default():
      x, opt, train_op, _ = _ema_step()
      # A hook whose fetches run the step too: the caller's op is named.
      hooks = [tf1.train.StopAtStepHook(last_step=100),
               tf1.train.LoggingTensorHook(opt.guard_result().counters, 1)]
      with tf1.train.MonitoredTrainingSession(hooks=hooks) as sess:
        with self.assertLogs(level="WARNING") as logs:
          sess.run(train_op, {x: test_util.GOOD_X})
          sess.run(train_op, {x: test_util.GOOD_X})
      self._assert_told_once(logs)

  def testSupervisorManagedSessionIsTold(self):
    # tf.compat.v1.train.Supervisor: the loop of slim.learning.train.
    with tf.Graph().as_default():
      x, _, train_op, _ = _ema_step()
      global_step = tf1.train.get_global_step()
      supervisor = tf1.train.Supervisor(
          logdir=None, global_step=global_step, summary_op=None, saver=None)
      with supervisor.managed_session("") as sess:
        with self.assertLogs(level="WARNING") as logs:
          sess.run([train_op, global_step], {x: test_util.GOOD_X})
      self._assert_told_once(logs)

  def testMakeCallableIsToldWhenMade(self):
    for feed_list in (False, True):
      with self.subTest(feed_list=feed_list), tf.Graph().as_default():
        x, _, train_op, _ = _ema_step()
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          with self.assertLogs(level="WARNING") as logs:
            if feed_list:
              step = sess.make_callable(train_op, feed_list=[x])
              step(test_util.GOOD_X)
              step(test_util.GOOD_X)
            else:
              sess.make_callable(train_op)
          self._assert_told_once(logs)

  def testKerasCallablePathIsToldWhenMade(self):
    # tf_keras' GraphExecutionFunction runs the train function through
    # Session._make_callable_from_options: feeds and a target, by name.
    with tf.Graph().as_default():
      x, _, train_op, loss = _ema_step()
      options = config_pb2.CallableOptions()
      options.feed.append(x.name)
      options.fetch.append(loss.name)
      options.target.append(train_op.name)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        with self.assertLogs(level="WARNING") as logs:
          step = sess._make_callable_from_options(options)  # pylint: disable=protected-access
        self._assert_told_once(logs)
        self.assertLen(step(test_util.GOOD_X), 1)

  def testStrictRefusesTheFirstRunBeforeItRuns(self):
    with tf.Graph().as_default():
      x, _, train_op, _ = _ema_step(strict=True)
      global_step = tf1.train.get_global_step()
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for _ in range(2):  # Refused every time, not only once.
          with self.assertRaisesRegex(
              ValueError, r"writes 2 variable\(s\) outside the skip "
              r"decision.*model/b/ExponentialMovingAverage.*opt\.protect"):
            sess.run(train_op, {x: test_util.GOOD_X})
        self.assertEqual(0, sess.run(global_step))  # Nothing ran.

  def testAWalkThatFailsNeitherStopsTheRunNorPassesSilently(self):
    # A graph the walk cannot read (a bug of ours, an op of a kind it does
    # not know) must not end a run the script would make; it is said, once
    # per fetch set, and a strict wrapper refuses the run.
    broken = mock.patch.object(write_check, "findings",
                               side_effect=KeyError("odd op"))
    with tf.Graph().as_default():
      x, _, train_op, _ = _ema_step()
      with tf1.Session() as sess, broken:
        sess.run(tf1.global_variables_initializer())
        with self.assertLogs(level="WARNING") as logs:
          for _ in range(2):
            sess.run(train_op, {x: test_util.GOOD_X})
    said = [l for l in logs.output if "could not analyse" in l]
    self.assertLen(said, 1, logs.output)
    self.assertIn("KeyError", said[0])
    with tf.Graph().as_default():
      x, _, train_op, _ = _ema_step(strict=True)
      with tf1.Session() as sess, broken:
        sess.run(tf1.global_variables_initializer())
        with self.assertRaisesRegex(ValueError, "could not analyse"):
          sess.run(train_op, {x: test_util.GOOD_X})

  def testProtectedTrainOpIsClean(self):
    with tf.Graph().as_default():
      x, _, train_op, _ = _ema_step(protect=True, strict=True)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})

  def testEvaluationRunIsNotCheckedOrTold(self):
    with tf.Graph().as_default():
      x, _, _, loss = _ema_step(strict=True)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(loss, {x: test_util.GOOD_X})  # strict: would raise.

  def testGanStepsEachRunAloneAreNotTold(self):
    # A GAN: two wrappers, two steps, each run by its own session.run.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      steps = []
      for scope in ("discriminator", "generator"):
        loss, var_list = test_util.model(x, scope=scope)
        opt = optimizer_lib.SkipNonFiniteOptimizer(
            tf1.train.AdamOptimizer(0.01), strict=True)  # strict: clean
        steps.append(opt.minimize(loss, var_list=var_list))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for step in steps:
          sess.run(step, {x: test_util.GOOD_X})
        with self.assertRaisesRegex(ValueError, "executes 2 guarded steps"):
          sess.run(steps, {x: test_util.GOOD_X})

  def testCheckRunsFalseTurnsItOff(self):
    with tf.Graph().as_default() as graph:
      x, _, train_op, _ = _ema_step(strict=True, check_runs=False)
      self.assertIsNone(run_check.graph_check(graph))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {x: test_util.GOOD_X})  # strict: would raise.

  def testOneWalkPerDistinctFetchSet(self):
    with tf.Graph().as_default() as graph:
      x, _, train_op, loss = _ema_step(protect=True)
      check = run_check.graph_check(graph)
      feed = {x: test_util.GOOD_X}
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        walks = check.walks
        for _ in range(3):
          sess.run(train_op, feed)
          sess.run(train_op, {x: test_util.GOOD_X2})  # Same feed keys.
        self.assertEqual(walks + 1, check.walks)
        for _ in range(2):
          sess.run([train_op, loss], feed)
          # The same ops in another structure: not walked again.
          sess.run({"loss": loss, "train": [train_op]}, feed)
          sess.run(loss, feed)
        self.assertEqual(walks + 3, check.walks)

  def testGoodStepsExecuteTheSameNodes(self):
    counts = []
    for check_runs in (False, True):
      with tf.Graph().as_default():
        tf1.set_random_seed(0)
        x, _, train_op, _ = _ema_step(protect=True, check_runs=check_runs)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          sess.run(train_op, {x: test_util.GOOD_X})
          counts.append(executed_ops.executed_nodes(
              sess, train_op, {x: test_util.GOOD_X}))
    self.assertEqual(counts[0], counts[1])


def _step_and_lr(strict):
  """The README's one line over a learning rate the script sets itself:
  (x, opt, train_op, loss, var_list, lr)."""
  x = tf1.placeholder(tf.float32, [3], name="x")
  loss, var_list = test_util.model(x)
  global_step = tf1.train.get_or_create_global_step()
  lr = tf1.Variable(0.1, trainable=False, name="learning_rate")
  opt = optimizer_lib.SkipNonFiniteOptimizer(
      tf1.train.MomentumOptimizer(lr, momentum=0.9), strict=strict)
  train_op = opt.minimize(loss, global_step=global_step)
  return x, opt, train_op, loss, var_list, lr


def _advised_line(message):
  """The `x = y.protect(x)` line a warning or refusal says to add."""
  return re.search(r"`(\w+ = [\w.]+\.protect\(\w+\))`", message).group(1)


class OtherFetchesTest(tf.test.TestCase):
  """Issue 32, item 10: what another fetch of the run writes."""

  def _run_with(self, other_fetch, strict):
    with tf.Graph().as_default():
      x, _, train_op, loss, _, lr = _step_and_lr(strict)
      other = other_fetch(loss, lr)
      with tf1.Session() as sess:
        sess.run([tf1.global_variables_initializer(),
                  tf1.local_variables_initializer()])
        with self.assertLogs(level="WARNING") as logs:
          tf1.logging.warning("a line, so that assertLogs has one")
          for _ in range(2):
            sess.run([train_op, other], {x: test_util.GOOD_X})
      return _told(logs)

  def testAMetricAndASetLearningRateAreTheScriptsOwn(self):
    # sess.run([train_op, metric_update]) with tf.compat.v1.metrics.mean,
    # sess.run([train_op, tf.compat.v1.assign(lr, lr_value)]): neither is
    # refused (strict) nor told; they read nothing the step writes.
    variants = {
        "metric": lambda loss, lr: tf1.metrics.mean(loss)[1],
        "learning_rate": lambda loss, lr: tf1.assign(lr, 0.05),
    }
    for name, other_fetch in variants.items():
      for strict in (True, False):
        with self.subTest(name=name, strict=strict):
          self.assertEqual([], self._run_with(other_fetch, strict))

  def testAnotherFetchReadingTheStepIsToldAndTheAdviceDoesNotLoop(self):
    # An EMA fetched beside the train op reads the weights the step writes:
    # it moves on a skipped step. The advice names it; followed literally,
    # the run is not refused again, and a skip leaves the EMA as it was.
    for v2, resource in ((True, True), (False, True), (False, False)):
      with self.subTest(control_flow_v2=v2, resource_variables=resource), \
          tf.Graph().as_default(), test_util.tf_config(v2, resource):
        x, opt, train_op, _, var_list, _ = _step_and_lr(strict=True)
        ema = tf1.train.ExponentialMovingAverage(0.9)
        ema_op = ema.apply(var_list)
        with tf1.Session() as sess:
          sess.run(tf1.global_variables_initializer())
          with self.assertRaisesRegex(
              ValueError, r"`ema_op` \('ExponentialMovingAverage'\), "
              r"fetched with the train op, writes 2 variable\(s\).*"
              r"model/b/ExponentialMovingAverage") as refused:
            sess.run([train_op, ema_op], {x: test_util.GOOD_X})
          line = _advised_line(str(refused.exception))
          self.assertEqual("ema_op = opt.protect(ema_op)", line)
          names = {"opt": opt, "ema_op": ema_op}
          exec(line, {}, names)  # pylint: disable=exec-used
          ema_op = names["ema_op"]
          sess.run(tf1.global_variables_initializer())
          sess.run([train_op, ema_op], {x: test_util.GOOD_X})  # Not refused.
          averages = [ema.average(v) for v in var_list]
          before = sess.run(averages)
          sess.run([train_op, ema_op], {x: test_util.NAN_X})  # Skipped.
          for was, kept in zip(before, sess.run(averages)):
            self.assertAllEqual(was, kept)


class CheckCostTest(tf.test.TestCase):
  """Issue 32, item 10: the check's cost when fetches change every run."""

  def testAStructureChangingEveryRunIsWalkedOnce(self):
    with tf.Graph().as_default() as graph:
      x, _, train_op, loss = _ema_step(protect=True)
      check = run_check.graph_check(graph)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        walks = check.walks
        for i in range(20):  # A dict of new keys for every run.
          sess.run({"loss_%d" % i: loss, "train": train_op},
                   {x: test_util.GOOD_X})
        self.assertEqual(walks + 1, check.walks)

  def testNewFetchOpsEveryRunStopBeingWalkedWithOneLine(self):
    with tf.Graph().as_default() as graph, mock.patch.object(
        run_check, "_MAX_CACHED", 3):
      x, _, train_op, loss = _ema_step(protect=True)
      check = run_check.graph_check(graph)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        with self.assertLogs(level="WARNING") as logs:
          for _ in range(8):  # A new op for every run.
            sess.run([train_op, tf.identity(loss)], {x: test_util.GOOD_X})
        self.assertEqual(3, check.walks)
    said = [l for l in logs.output if "checks no new one" in l]
    self.assertLen(said, 1, logs.output)


class TrainerTest(tf.test.TestCase):

  def testTrainersStepIsNotWatched(self):
    # The trainer builds its step with check_runs=False: no check, no cost.
    # pylint: disable=g-import-not-at-top
    from bench import guard_overhead_lib
    images, labels = guard_overhead_lib.fixed_batch(2)
    variant = guard_overhead_lib.build_variant(
        "guarded_trainer_step", "small_cnn", images, labels)
    self.assertIsNone(run_check.graph_check(variant.session.graph))
    variant.session.close()


if __name__ == "__main__":
  tf.test.main()
