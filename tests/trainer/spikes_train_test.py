"""End-to-end tests of --skip_spikes_sigma in the trainer (virtual CPUs).

Each run builds a graph (seconds): one two-tower run in `setUpClass` proves
the drill's skip and a streak's re-warm; the claims not about towers run on
one tower.
"""

import os
import tempfile

from absl import logging
import numpy as np
import tensorflow as tf

from tests.fixtures import run_logs
from tests.fixtures import train_dirs
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.inputs import exclusion
from tf1_safe_train.trainer.explain import forensics
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

# A finite spike (tower 1's gradients x 1e4) at step 8, a NaN at step 10.
_DRILL = "scale1e4@8:1,nan@10:0"
# The same on one tower (its gradients x 1e4), for the claims not about
# towers: a one-tower run builds faster.
_ONE_TOWER_DRILL = "scale1e4@8:0,nan@10:0"


def _params(train_dir, **overrides):
  values = dict(train_dir=train_dir, num_towers=2, device="cpu", batch_size=8,
                max_steps=12, save_checkpoints_steps=1000,
                save_summaries_steps=1000, log_every_n_steps=100,
                spike_warmup_steps=5)
  values.update(overrides)
  return params_lib.TrainParams(**values).validate()


def _skip_lines(logs):
  return [r.getMessage() for r in logs.records
          if "skipped step" in r.getMessage()]


class SpikesTrainTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One run proves the drill's skip and the streak's re-warm: the spike at
    # 8, the NaN at 10, then tower gradients x 1e3 from step 12 on: three
    # spike skips (12-14, the third re-warms), then step 15 applied in the
    # warm-up (a fourth skip would have given up: --max_consecutive_skips=4).
    cls.drill_dir = os.path.join(
        tempfile.mkdtemp(dir=tf1.test.get_temp_dir()), "drill")
    with run_logs.capture(logging.get_absl_logger(), "INFO") as logs:
      cls.drill = train_lib.train(_params(
          cls.drill_dir, skip_spikes_sigma=6.0, spike_max_streak=3,
          max_consecutive_skips=4, max_steps=16, log_every_n_steps=16,
          save_checkpoints_steps=12,
          inject_nonfinite=_DRILL + ",scale1e3@12-:0,scale1e3@12-:1"))
    cls.drill_logs = logs

  def _train_dir(self, name):
    return os.path.join(self.get_temp_dir(), name)

  def testDrillSpikeIsSkippedAndCountedByReason(self):
    summary, logs, train_dir = self.drill, self.drill_logs, self.drill_dir
    # Skipped: the spike at 8, the NaN at 10, the streak's 12-14.
    self.assertEqual((summary["applied_steps"], summary["skipped_steps"]),
                     (11, 5))
    self.assertEqual(summary["spike_skips"], 4)
    self.assertEqual(summary["nonfinite_skips"], 1)
    self.assertLess(summary["final_loss"], 10.0)
    lines = _skip_lines(logs)
    self.assertLen(lines, 5)
    self.assertRegex(lines[0], r"skipped step 8: spike, gradient norm "
                     r"\S+ > threshold \S+")
    self.assertIn("skipped step 10: non-finite", lines[1])
    # The progress line tells the reasons apart too.
    self.assertLen([r for r in logs.records if "applied 11  skipped 5 (4 "
                    "spikes)" in r.getMessage()], 1)
    self.assertEqual(train_dirs.checkpoint_values(train_dir)[
        "spike_skips"], 4)
    # Before the streak (step 12's checkpoint): statistics of the 10 applied
    # steps only; finite.
    (at_12,) = [p for p in train_dirs.checkpoint_paths(train_dir)
                if p.endswith("-12")]
    values = train_dirs.checkpoint_values(at_12)
    self.assertEqual(values["spike_skips"], 1)
    self.assertEqual(values["spike_stats/applied"], 10)
    self.assertTrue(np.isfinite(values["spike_stats/grad_norm_log_var"]))
    # Recorded like any skip: its reason, values and examples, no replay.
    records = skip_log.read(skip_log.path(train_dir))
    self.assertEqual([r["step"] for r in records], [8, 10, 12, 13, 14])
    spike, nan = records[:2]
    self.assertEqual((spike["step"], spike["reason"], nan["reason"]),
                     (8, "spike", "nonfinite"))
    self.assertEqual(spike["verdict"], forensics.SPIKE)
    self.assertGreater(spike["spike"]["grad_norm"],
                       spike["spike"]["grad_threshold"])
    self.assertNotIn("replay", spike)
    self.assertNotIn("reproduced", spike)
    self.assertEqual([len(t["example_ids"]) for t in spike["towers"]], [8, 8])
    self.assertEqual(summary["forensics"]["verdicts"]["spike"], 4)
    self.assertEqual(summary["forensics"]["all_verdicts"]["spike"], 4)
    # Its (good) examples are never excluded.
    self.assertEmpty(set(exclusion.excluded(train_dir)[0]) & set(
        spike["towers"][1]["example_ids"]))

  def testWithoutTheOptionTheDrillHurtsAndAResumeWithItWarmsUp(self):
    train_dir = self._train_dir("off")
    summary = train_lib.train(_params(train_dir, num_towers=1,
                                      inject_nonfinite=_ONE_TOWER_DRILL))
    self.assertEqual((summary["skipped_steps"], summary["nonfinite_skips"],
                      summary["spike_skips"]), (1, 1, 0))
    self.assertGreater(summary["final_loss"], 100.0)
    # The graph is the one without the option: no spike state saved.
    self.assertEmpty([name for name in train_dirs.checkpoint_values(
        train_dir) if "spike" in name])
    # That checkpoint (written without the option) resumes with it.
    second = train_lib.train(_params(train_dir, num_towers=1, max_steps=16,
                                     skip_spikes_sigma=6.0))
    self.assertEqual(second["steps_this_run"], 4)
    self.assertEqual((second["applied_steps"], second["nonfinite_skips"],
                      second["spike_skips"]), (15, 1, 0))
    values = train_dirs.checkpoint_values(train_dir)
    self.assertEqual(values["spike_stats/applied"], 4)  # Warming up again.

  def testStreakOfSpikesRewarmsInsteadOfGivingUp(self):
    # The fixture's streak: spike skips at 12-14 (the drill's spike at 8
    # makes 4), the third re-warms, step 15 applied: no give-up.
    summary = self.drill
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(summary["spike_skips"], 4)
    lines = _skip_lines(self.drill_logs)
    self.assertIn("skipped step 14: spike", lines[4])
    self.assertIn("re-warms", lines[4])
    self.assertEqual(train_dirs.checkpoint_values(self.drill_dir)[
        "spike_stats/rewarms"], 1)

  def testDryRunSkipsNothingAndReportsTheWouldBeSkip(self):
    train_dir = self._train_dir("dry_run")
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      summary = train_lib.train(_params(
          train_dir, num_towers=1, skip_spikes_sigma=6.0, spike_dry_run=True,
          inject_nonfinite="scale1e4@8:0", max_steps=10,
          log_every_n_steps=10))
    self.assertEqual((summary["applied_steps"], summary["skipped_steps"]),
                     (10, 0))
    self.assertEqual(summary["skips_by_reason"], {"nonfinite": 0})
    self.assertEqual(summary["would_skips_by_reason"], {"spike": 1})
    messages = [r.getMessage() for r in logs.records]
    self.assertEmpty([m for m in messages if "skipped step" in m])
    lines = [m for m in messages if "would be skipped" in m and "norm" in m]
    self.assertLen(lines, 1)
    self.assertRegex(lines[0], r"^step 8: spike would be skipped \(dry run: "
                     r"applied\), gradient norm \S+ > threshold \S+$")
    self.assertLen([m for m in messages if "applied 10  skipped 0 (1 "
                    "would-be spike)" in m], 1)
    (record,) = skip_log.read(skip_log.path(train_dir))
    self.assertEqual((record["step"], record["reason"], record["dry_run"],
                      record["verdict"]),
                     (8, "spike", True, forensics.DRY_RUN % "spike"))
    self.assertGreater(record["spike"]["grad_norm"],
                       record["spike"]["grad_threshold"])
    self.assertEqual(summary["forensics"]["verdicts"],
                     {"spike_would_skip": 1})
    self.assertEmpty(exclusion.excluded(train_dir)[0])
    values = train_dirs.checkpoint_values(train_dir)
    self.assertEqual(values["spike_would_skips"], 1)
    # The would-be spike is an applied step: in the statistics too.
    self.assertEqual(values["spike_stats/applied"], 10)
    self.assertNotIn("spike_skips", values)

  def testBadValuesAreOneLineErrors(self):
    for overrides, message in (
        (dict(skip_spikes_sigma=-1.0), "--skip_spikes_sigma=-1.0"),
        (dict(skip_spikes_sigma=float("inf")), "--skip_spikes_sigma=inf"),
        (dict(spike_warmup_steps=0), "--spike_warmup_steps=0"),
        (dict(spike_max_streak=2.5), "--spike_max_streak=2.5"),
        (dict(skip_loss_spikes=True), "needs --skip_spikes_sigma"),
        (dict(spike_dry_run=True), "--spike_dry_run needs "
         "--skip_spikes_sigma > 0"),
        (dict(spike_dry_run=1, skip_spikes_sigma=6.0),
         "--spike_dry_run=1: must be a boolean"),
        (dict(skip_spikes_sigma=6.0, spike_max_streak=50),
         "--spike_max_streak=50: must be below --max_consecutive_skips=50"),
        (dict(skip_loss_spikes=True, skip_spikes_sigma=6.0,
              sync_replicas=True), "not supported with --sync_replicas")):
      with self.assertRaisesRegex(params_lib.ParamsError, message) as error:
        _params("/tmp/unused", **overrides)
      self.assertNotIn("\n", str(error.exception))


if __name__ == "__main__":
  tf.test.main()
