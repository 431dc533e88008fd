"""A skip criterion defined here, run through the wrapper and the trainer.

`criteria.Criterion` is the library's one interface for a reason to skip:
this file's own `LossAbove` (a step whose loss, or a tower's, exceeds a
threshold) goes through `SkipNonFiniteOptimizer(criteria=...)` and the
trainer's `train_lib.train(criteria=...)` with no library change, and is
reported, labelled and counted as the library's own criteria are.
"""

import os

from absl import logging
import numpy as np
import tensorflow as tf

from tests.fixtures import event_files
from tests.fixtures import forensics_params
from tf1_safe_train.core import criteria
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import skip_log
from tf1_safe_train.core import summaries
from tf1_safe_train.trainer.explain import forensics
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1


class LossAbove(criteria.Criterion):
  """Skips a step whose loss (or largest tower loss) is above a threshold."""

  def __init__(self, threshold, per_tower=False, reason="loss_above"):
    self.threshold = float(threshold)
    self.per_tower = per_tower
    self.reason = reason

  def decide(self, context):
    loss = (tf.reduce_max(context.towers["loss"]) if self.per_tower
            else context.loss)
    self._values = {"loss": tf.cast(loss, tf.float32),
                    "threshold": tf.constant(self.threshold)}
    return tf.logical_and(self._values["loss"] > self.threshold,
                          tf.logical_not(context.nonfinite))

  def values(self):
    return self._values

  def describe(self, values):
    return "loss %.4g > threshold %.4g" % (values["loss"],
                                           values["threshold"])


class _Snapshots(tf1.train.SessionRunHook):
  """The trainable variables after each step."""

  def __init__(self):
    self.after = []

  def after_run(self, run_context, run_values):
    self.after.append(run_context.session.run(tf1.trainable_variables()))


class WrapperCriterionTest(tf.test.TestCase):

  def testOwnCriterionSkipsLabelsAndCounts(self):
    log_path = os.path.join(self.get_temp_dir(), "wrapper", "skips.jsonl")
    os.makedirs(os.path.dirname(log_path))
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0, 3.0]))
      loss = tf.reduce_sum(x * w)
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1),
          criteria=[LossAbove(10.0)])
      global_step = tf1.train.get_or_create_global_step()
      train_op = opt.minimize(loss, global_step=global_step)
      counts = opt.guard_result().reasons.counts
      summary = summaries.skip_reasons(opt)
      hook = opt.report_hook(skip_log_path=log_path)
      with tf1.train.SingularMonitoredSession(hooks=[hook]) as sess:
        sess.run(train_op, {x: [0.1, 0.1, 0.1]})  # loss 0.6: applied.
        before = sess.run(w)
        # (The counts are read after the step: fetched with it.)
        _, after, tags = sess.run([train_op, counts, summary],
                                  {x: [5.0, 5.0, 5.0]})  # loss ~28: skipped.
        self.assertAllEqual(before, sess.run(w))  # Bit-identical.
        self.assertEqual(after, {"nonfinite_skips": 0, "loss_above_skips": 1})
        tags = tf1.Summary.FromString(tags)
        self.assertEqual({v.tag: v.simple_value for v in tags.value},
                         {"skips/nonfinite_skips": 0.0,
                          "skips/loss_above_skips": 1.0})
    self.assertLen(hook.reports, 1)
    self.assertRegex(hook.reports[0], r"^skipped step 1: loss_above, loss "
                     r"\S+ > threshold 10$")
    (record,) = skip_log.read(log_path)
    self.assertEqual((record["step"], record["reason"]), (1, "loss_above"))
    self.assertEqual(record["loss_above"]["threshold"], 10.0)
    self.assertGreater(record["loss_above"]["loss"], 10.0)

  def testReasonsMustBeDistinctAndNamed(self):
    with self.assertRaisesRegex(ValueError, "two skip criteria have the "
                                "reason loss_above"):
      optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1),
          criteria=[LossAbove(1.0), LossAbove(2.0)])
    with self.assertRaisesRegex(ValueError, "reason='Bad reason'"):
      optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1),
          criteria=[LossAbove(1.0, reason="Bad reason")])
    with self.assertRaisesRegex(ValueError, "must be a criteria.Criterion"):
      optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), criteria=[object()])


  def testOnlyACriterionThatReadsTheLossNeedsOne(self):
    # (No `needs_loss` to declare: reading `Context.loss` is the need.)
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=tf.constant([1.0]))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1),
          criteria=[LossAbove(1.0)])
      with self.assertRaisesRegex(ValueError, "reads the step's loss, which "
                                  "this step does not have"):
        opt.apply_gradients([(tf.constant([1.0]), w)])
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=tf.constant([1.0]))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), skip_spikes=3.0,
          skip_grad_norm_above=10.0)
      train_op = opt.apply_gradients([(tf.constant([1.0]), w)])
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op)
        self.assertAllClose(sess.run(w), [0.9])  # Applied.


class TrainerCriterionTest(tf.test.TestCase):

  def testOwnCriterionOnTowerLossesSkipsLabelsAndCounts(self):
    train_dir = os.path.join(self.get_temp_dir(), "trainer")
    snapshots = _Snapshots()
    # Tower 1's loss x 1e3 at step 2 (finite): only the criterion skips it.
    params = forensics_params.params(
        train_dir, inject_nonfinite="scale1e3@2:1", inject_into="loss",
        save_summaries_steps=1)
    with self.assertLogs(logging.get_absl_logger(), "WARNING") as logs:
      summary = train_lib.train(
          params, extra_hooks=[snapshots],
          criteria=[LossAbove(100.0, per_tower=True,
                              reason="tower_loss_above")])
    self.assertEqual((summary["applied_steps"], summary["skipped_steps"]),
                     (3, 1))
    self.assertEqual(summary["skips_by_reason"],
                     {"nonfinite": 0, "tower_loss_above": 1})
    for after, before in zip(snapshots.after[2], snapshots.after[1]):
      self.assertAllEqual(before, after)  # Bit-identical on its skip.
    lines = [r.getMessage() for r in logs.records
             if "skipped step" in r.getMessage()]
    self.assertLen(lines, 1)
    self.assertRegex(lines[0], r"^skipped step 2: tower_loss_above, loss "
                     r"\S+ > threshold 100$")
    (record,) = skip_log.read(skip_log.path(train_dir))
    self.assertEqual((record["step"], record["reason"], record["verdict"]),
                     (2, "tower_loss_above",
                      forensics.FINITE % "tower_loss_above"))
    self.assertGreater(record["tower_loss_above"]["loss"], 100.0)
    self.assertNotIn("replay", record)
    self.assertEqual(summary["forensics"]["verdicts"],
                     {"tower_loss_above": 1})
    self.assertEqual(event_files.last_scalars(train_dir, "skips/"), dict(
        event_files.last_scalars(train_dir, "skips/"), **{
            "skips/nonfinite_skips": 0.0,
            "skips/tower_loss_above_skips": 1.0}))


if __name__ == "__main__":
  tf.test.main()
