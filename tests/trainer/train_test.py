"""End-to-end tests of the multi-tower trainer on virtual CPU devices."""

import json
import os

from absl import logging
import numpy as np
import tensorflow as tf

from tests.fixtures import train_dirs
from tf1_safe_train.core import cond_walk
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.explain import forensics as forensics_lib
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.run import run_summary
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1


def _params(train_dir, **overrides):
  # No test here reads a skip's forensics (forensics_test's): its replay and
  # saved state would cost a short run more than its steps.
  values = dict(train_dir=train_dir, num_towers=2, device="cpu", batch_size=8,
                max_steps=6, save_checkpoints_steps=1000,
                save_summaries_steps=1000, log_every_n_steps=2,
                max_explained_skips=0)
  values.update(overrides)
  return params_lib.TrainParams(**values).validate()


def _read_summary(train_dir):
  with open(os.path.join(train_dir, run_summary.RUN_SUMMARY)) as f:
    return json.load(f)


class TrainTest(tf.test.TestCase):

  def _train_dir(self, name):
    return os.path.join(self.get_temp_dir(), name)

  def testOneTowerDecidesWithFusedChecksAndReportsFromTheSkipBranch(self):
    # A good step checks the gradients and the batch-norm statistics written
    # before the decision with a few fused checks (one per group of shapes);
    # the report's one check per gradient and statistic is built in the
    # decision's skip branch only.
    # resnet8: the same kinds of layers as resnet20, batch norm included, at
    # a third of the graph.
    params = _params(self._train_dir("graph"), num_towers=1, model="resnet8")
    with tf.Graph().as_default() as graph:
      step = train_step.build_step(params, local_replication.Local(params))
      # The replay probes' checks run only when a skip is replayed.
      fused = [op for op in graph.get_operations() if op.type == "IsFinite"
               and "/nonfinite_probe/" not in op.name]
      statistics = [n for n in step.report.variable_names if "moving_" in n]
      self.assertLen(statistics, 14)  # 7 batch norms, mean and variance.
      variables = len(tf1.trainable_variables()) + len(statistics)
      self.assertLen(step.report.variable_names, variables)
      self.assertLess(len(fused), 10)
      # (The towers' input and the last applied batch have conds of their
      # own: tower_input, batch_store.)
      decisions = [op for op in graph.get_operations() if op.type == "If"
                   and op.name.startswith("guarded_step/")]
      self.assertLen(decisions, 1)
      apply_branch, skip_branch = cond_walk.branch_graphs(decisions[0])
      for branch, checks in ((apply_branch, 0), (skip_branch, variables)):
        self.assertLen([op for op in branch.get_operations()
                        if op.type == "IsFinite"], checks)

  def testReplayProbesAndSkipSaverOnlyWhereTheRunCanReplay(self):
    # The probes check every op of a tower (doubling its graph) and the
    # saver writes a skip's state: a run that never replays builds neither,
    # and refuses to replay rather than fail at a missing probe.
    for overrides, replays in (
        ({}, False),  # --max_explained_skips=0 (`_params`).
        ({"max_explained_skips": 1}, True),
        # Quarantine replays a tower past --max_explained_skips.
        ({"skip_unit": "tower", "quarantine_after": 2}, True)):
      params = _params(self._train_dir("probes"), **overrides)
      with tf.Graph().as_default() as graph:
        step = train_step.build_step(params, local_replication.Local(params))
        probes = [op for op in graph.get_operations()
                  if "/nonfinite_probe/" in op.name]
        self.assertEqual(bool(probes), replays, overrides)
        forensics = step.forensics
        self.assertEqual(forensics.replays, replays, overrides)
        self.assertEqual(forensics.saver is not None, replays, overrides)
        self.assertEqual([t.probe is not None for t in forensics.towers],
                         [replays] * 2, overrides)
        # What every skip's record reads is there either way.
        self.assertLen([t.loss for t in forensics.towers], 2)
        if not replays:
          with self.assertRaisesRegex(ValueError, "without replay probes"):
            replay_lib.explain(None, forensics, 0, None)
          with self.assertRaisesRegex(ValueError, "without replay probes"):
            forensics_lib.ForensicsHook(step, params, max_explained=1)

  def testLearningRateScheduleFollowsAppliedStepsByDefault(self):
    # Step 1 is skipped. Summaries are logged under the global_step after
    # the step (s + 1); the rate of step s comes from the schedule's step
    # before step s ran. (The schedule is float32 whatever the precision:
    # the second run is also testBfloat16Trains's. The first is also the
    # three-tower give-up run: steps 0 and 2 applied in both runs, so the
    # rates compared below, of steps 0 to 3, are those of one skip at
    # step 1; max_steps is above the give-up's step and equal in both runs,
    # as the cosine schedule decays over it.)
    rates = {}
    for schedule_step, num_towers, precision in (
        ("applied_steps", 3, "fp32"), ("global_step", 1, "bf16")):
      train_dir = self._train_dir("lr_" + schedule_step)
      if num_towers == 3:
        # Tower 2's loss is poisoned at step 1 (-inf), then from step 3 on
        # (nan); the third skip in a row (step 5) gives up.
        drill = dict(max_consecutive_skips=3, inject_into="loss",
                     inject_nonfinite="-inf@1:2,nan@3-:2")
      else:
        drill = dict(inject_nonfinite="nan@1:0")
      summary = train_lib.train(_params(
          train_dir, num_towers=num_towers, max_steps=7,
          save_summaries_steps=1, lr_schedule="cosine",
          lr_schedule_step=schedule_step, precision=precision, **drill))
      rates[schedule_step] = train_dirs.scalars(train_dir, "learning_rate")
      if num_towers == 3:
        self.assertThreeTowersCountPerTowerAndGiveUp(summary, train_dir)
        self.assertSummariesEveryStepSurviveTheSkip(train_dir)
      else:
        self.assertBfloat16Trains(summary)
    applied, by_global = rates["applied_steps"], rates["global_step"]
    self.assertEqual([1, 2, 3, 4, 5, 6], [s for s, _ in applied])
    # Skipped step 1 did not advance the schedule: steps 1 and 2 share a rate.
    self.assertEqual(applied[1][1], applied[2][1])
    self.assertGreater(applied[2][1], applied[3][1])
    # On global_step, every step decays the rate.
    self.assertGreater(by_global[1][1], by_global[2][1])
    self.assertEqual(applied[3][1], by_global[2][1])

  def testTwoTowersSkipNameTowerAndVariableAndResumeKeepsCounters(self):
    # One run is both the skip-report run and the resume's first run (with
    # EMA, clipping, a cosine schedule and Adam: none changes what the
    # report names).
    train_dir = self._train_dir("two")
    options = dict(moving_average_decay=0.99, clip_gradient_norm=1.0,
                   lr_schedule="cosine", optimizer="adam")
    with self.assertLogs(logging.get_absl_logger(), "WARNING") as logs:
      summary = train_lib.train(_params(
          train_dir, inject_nonfinite="nan@2:1,inf@4:0", **options))
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(summary["global_step"], 6)
    self.assertEqual(summary["skipped_steps"], 2)
    self.assertEqual(summary["applied_steps"], 4)
    self.assertEqual(summary["nonfinite_steps_by_tower"], [1, 1])
    self.assertEqual(summary["max_consecutive_skips_seen"], 1)
    self.assertEqual(_read_summary(train_dir), summary)
    reports = [r.getMessage() for r in logs.records
               if "skipped step" in r.getMessage()]
    self.assertLen(reports, 2)
    self.assertIn("skipped step 2", reports[0])
    self.assertIn("tower 1 (/device:CPU:1)", reports[0])
    # --inject_into=grads poisons the first trainable variable's gradient.
    first_variable = "small_cnn/conv1/weights"
    self.assertIn(first_variable, reports[0])
    self.assertIn("skipped step 4", reports[1])
    self.assertIn("tower 0 (/device:CPU:0)", reports[1])
    self.assertSkipsRecordedWithoutReplay(train_dir, [2, 4])
    values = train_dirs.checkpoint_values(train_dir)
    for name, value in values.items():
      if np.issubdtype(np.asarray(value).dtype, np.floating):
        self.assertTrue(np.isfinite(value).all(), name)
    self.assertEqual(values["skipped_steps"], 2)
    # EMA and clipping train without NaN: the EMA shadows are among the
    # finite entries above.
    ema = [n for n in values if n.endswith("ExponentialMovingAverage")]
    self.assertNotEmpty(ema)
    # The resume keeps the counters and goes on from step 6 (applied), its
    # skip at step 7 counted on top of the restored counters.
    second = train_lib.train(_params(train_dir, max_steps=8,
                                     inject_nonfinite="nan@7:1", **options))
    self.assertEqual(second["global_step"], 8)
    self.assertEqual(second["steps_this_run"], 2)
    self.assertEqual((second["applied_steps"], second["skipped_steps"]),
                     (5, 3))
    self.assertEqual(second["nonfinite_steps_by_tower"], [1, 2])

  def assertThreeTowersCountPerTowerAndGiveUp(self, summary, train_dir):
    """A three-tower run whose tower 2 was poisoned at step 1, then from
    step 3 on, with max_consecutive_skips=3 (this was
    testThreeTowersCountPerTowerAndGiveUpAfterConsecutiveSkips's)."""
    self.assertEqual(summary["nonfinite_steps_by_tower"], [0, 0, 4])
    self.assertEqual(summary["skipped_steps"], 4)
    self.assertEqual(summary["applied_steps"], 2)
    self.assertEqual(summary["exit_reason"], "too_many_consecutive_skips")
    self.assertEqual(summary["consecutive_skips"], 3)
    self.assertEqual(summary["global_step"], 6)
    self.assertEqual(_read_summary(train_dir)["exit_reason"],
                     "too_many_consecutive_skips")

  def _one_tower_no_increment_run(self):
    """(summary, train_dir) of the run the next two tests share (made once).

    One tower of resnet8 (resnet20's batch norms at a third of its graph),
    its input poisoned at step 1; skipped steps do not advance global_step,
    so the drill keyed on step 1 hits every following step until the
    give-up: three skips, each in tower 0, whose update ops write the
    batch-norm moving statistics (with more towers too: one tower is enough,
    and the model's graph per tower is most of this run's cost).
    """
    cls = type(self)
    if not hasattr(cls, "_no_increment_run"):
      train_dir = self._train_dir("no_increment")
      cls._no_increment_run = (train_lib.train(_params(
          train_dir, model="resnet8", num_towers=1, max_steps=5,
          batch_size=4, max_consecutive_skips=3,
          increment_global_step_on_skip=False, inject_nonfinite="nan@1:0",
          inject_into="input")), train_dir)
    return cls._no_increment_run

  def testInputInjectionLeavesBatchNormStatisticsFinite(self):
    summary, train_dir = self._one_tower_no_increment_run()
    self.assertEqual(summary["skipped_steps"], 3)
    values = train_dirs.checkpoint_values(train_dir)
    moving = [n for n in values if n.endswith("moving_mean") or
              n.endswith("moving_variance")]
    self.assertNotEmpty(moving)
    for name in moving:
      self.assertTrue(np.isfinite(values[name]).all(), name)
    for name, value in values.items():
      if np.issubdtype(np.asarray(value).dtype, np.floating):
        self.assertTrue(np.isfinite(value).all(), name)

  def testSkipPolicyWithoutGlobalStepIncrement(self):
    summary, _ = self._one_tower_no_increment_run()
    self.assertEqual(summary["global_step"], 1)
    self.assertEqual(summary["applied_steps"], 1)
    self.assertEqual(summary["skipped_steps"], 3)
    self.assertEqual(summary["exit_reason"], "too_many_consecutive_skips")

  def assertSummariesEveryStepSurviveTheSkip(self, train_dir):
    """Every summary of a 3-tower run that skipped step 1 and steps 3 to 5
    (all summarised) is in its events, the skip counters' included (this
    was testSummariesEveryStepSurviveSkips's own run)."""
    tags = set()
    for path in tf1.gfile.Glob(os.path.join(train_dir, "events.*")):
      for event in tf1.train.summary_iterator(path):
        tags.update(v.tag for v in event.summary.value)
    for tag in ("loss", "learning_rate", "skips/applied_steps",
                "skips/skipped_steps", "skips/consecutive_skips",
                "skips/nonfinite_steps_tower_0",
                "skips/nonfinite_steps_tower_1",
                "skips/nonfinite_steps_tower_2"):
      self.assertIn(tag, tags)
    self.assertEqual(train_dirs.scalars(train_dir, "skips/skipped_steps")
                     [-1][1], 4.0)

  def testFloat16SkipHalvesTheLossScale(self):
    # float16 convolutions are emulated on CPU (a few examples/s), so this
    # run is tiny: it checks the mechanism, not that fp16 trains well (one
    # tower: the loss scale is one for all towers).
    train_dir = self._train_dir("fp16")
    with self.assertLogs(logging.get_absl_logger(), "WARNING") as logs:
      summary = train_lib.train(_params(
          train_dir, precision="fp16", num_towers=1, batch_size=2,
          max_steps=4, initial_loss_scale=1024.0, loss_scale_growth_steps=2,
          inject_nonfinite="nan@3:0"))
    # Steps 0 and 1 applied: 1024 -> 2048; step 2 applied; step 3 skipped:
    # 2048 -> 1024.
    self.assertEqual(summary["skipped_steps"], 1)
    self.assertEqual(summary["loss_scale"], 1024.0)
    values = train_dirs.checkpoint_values(train_dir)
    self.assertEqual(values["loss_scale/scale"], 1024.0)
    for name, value in values.items():
      if np.issubdtype(np.asarray(value).dtype, np.floating):
        self.assertTrue(np.isfinite(value).all(), name)
    reports = [r.getMessage() for r in logs.records
               if "skipped step 3" in r.getMessage()]
    self.assertLen(reports, 1)
    self.assertIn("loss-scale overflow at scale 2048", reports[0])

  def assertSkipsRecordedWithoutReplay(self, train_dir, steps):
    """--max_explained_skips=0 (a step built without replay probes): each
    skip still has its record, every field but a replay's."""
    records = skip_log.read_all(train_dir)
    self.assertEqual([r["step"] for r in records], steps)
    for record in records:
      self.assertEqual(sorted(record), ["reason", "seconds", "step", "time",
                                        "towers", "verdict", "worker"])
      self.assertEqual(record["verdict"], forensics_lib.NOT_EXPLAINED)
      self.assertEqual(record["reason"], "nonfinite")
      for tower in record["towers"]:
        self.assertEqual(sorted(tower), [
            "batch_hash", "device", "example_ids", "index", "loss",
            "nonfinite", "variables"])
        self.assertLen(tower["example_ids"], 8)
        self.assertTrue(np.isfinite(tower["loss"]))
    self.assertFalse(os.path.exists(os.path.join(train_dir,
                                                 forensics_lib.SKIPS_DIR)))

  def assertBfloat16Trains(self, summary):
    """A bf16 run that skipped one step (this was testBfloat16Trains's):
    no loss scale, a finite final loss."""
    self.assertEqual(summary["skipped_steps"], 1)
    self.assertNotIn("loss_scale", summary)
    self.assertTrue(np.isfinite(summary["final_loss"]))


if __name__ == "__main__":
  tf.test.main()
