"""A run says what it is about to do, and what it did (issue 37, point 3).

`//:train` runs, as a user runs it, for 10 steps (shorter than one progress
line) with a drill skipping step 5: its log starts with the banner (model,
towers and their devices, batch per tower and per step, precision, the skip
criteria and unit, drills, fresh or resumed, train_dir) and ends with one
line saying the steps applied and skipped by reason, the final loss, the
examples/sec over the run and where run_summary.json is, its numbers the
file's. A second run in the same train_dir says which step it resumed from.
"""

import json
import os
import re

import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train.trainer.run import run_story

# The banner line of `label` in a log: absl's prefix, run_story's line.
_BANNER = r"(?m)^I\d{4} [\d:.]+ +\d+ run_story\.py:\d+\] %s: +(.*)$"


def _banner(stderr, label):
  match = re.search(_BANNER % re.escape(label), stderr)
  return match.group(1) if match else None


class RunStoryTest(tf.test.TestCase):

  def testATenStepRunSaysWhatItRunsAndEndsWithWhatItDid(self):
    train_dir = os.path.join(self.get_temp_dir(), "ten")
    result = binaries.run("train", "--train_dir=" + train_dir,
                          "--max_steps=10", "--batch_size=4",
                          "--inject_nonfinite=nan@5:1")
    self.assertEqual(result.returncode, 0, result.stderr)
    log = result.stderr
    self.assertStartsWith(_banner(log, "Model"), "small_cnn on synthetic")
    self.assertEqual(_banner(log, "Towers"),
                     "2 (/device:CPU:0, /device:CPU:1); variables on "
                     "/device:CPU:0")
    self.assertEqual(_banner(log, "Batch size"), "4 per tower, 8 per step")
    self.assertEqual(_banner(log, "Precision"), "fp32")
    self.assertIn("NaN/Inf", _banner(log, "Skip when"))
    self.assertStartsWith(_banner(log, "Skip unit"), "step")
    self.assertStartsWith(_banner(log, "Drills"), "nan@5:1")
    self.assertEqual(_banner(log, "Steps"), "a fresh run, steps 1 to 10")
    self.assertEqual(_banner(log, "Train dir"), train_dir)
    # The banner comes before the first step's lines (the skip of step 5).
    self.assertLess(log.index("Train dir:"), log.index("skipped step 5"))

    last = log.strip().splitlines()[-1]
    with open(os.path.join(train_dir, "run_summary.json")) as f:
      summary = json.load(f)
    self.assertRegex(
        last, r"run_story\.py:\d+\] run ended at step 10 \(max_steps\): "
        r"10 steps run, applied 9, skipped 1 \(nonfinite 1\), final loss "
        r"%.4f, total examples/sec %.2f, wall [\d.]+ s; run summary: %s$" % (
            summary["final_loss"], summary["examples_per_sec"],
            re.escape(os.path.join(train_dir, "run_summary.json"))))

    again = binaries.run("train", "--train_dir=" + train_dir,
                         "--max_steps=12", "--batch_size=4")
    self.assertEqual(again.returncode, 0, again.stderr)
    self.assertEqual(_banner(again.stderr, "Steps"),
                     "resumed from step 10 (model.ckpt-10), to step 12")
    self.assertEqual(_banner(again.stderr, "Drills"), "none")
    self.assertIn("run ended at step 12 (max_steps): 2 steps run, applied "
                  "11, skipped 1 (nonfinite 1)",
                  again.stderr.strip().splitlines()[-1])

  def testTheBannerSaysTheTowerUnitSpikesAndFp16(self):
    params = _Params(skip_unit="tower", min_healthy_towers=1,
                     skip_spikes_sigma=6.0, spike_dry_run=True,
                     precision="fp16", quarantine_after=2)
    lines = dict(run_story.banner(
        params, ["/device:CPU:0", "/device:CPU:1"], None,
        [_Criterion("nonfinite"), _Criterion("spike", dry_run=True)],
        "/tmp/x/model.ckpt-60", quarantined=(1,)))
    self.assertEqual(lines["Towers"], "2 (/device:CPU:0, /device:CPU:1 "
                     "(tower 1 quarantined))")
    self.assertIn("spike: gradient norm over 6 sigma", lines["Skip when"])
    self.assertIn("dry run", lines["Skip when"])
    self.assertStartsWith(lines["Skip unit"], "tower")
    self.assertIn("quarantined after 2", lines["Skip unit"])
    self.assertStartsWith(lines["Precision"], "fp16, dynamic loss scale")
    self.assertEqual(lines["Steps"],
                     "resumed from step 60 (model.ckpt-60), to step 100")
    self.assertEqual(lines["Batch size"], "32 per tower, 32 per step")

  def testTheBannerOfASynchronousWorker(self):
    lines = dict(run_story.banner(
        _Params(sync_replicas=True), ["/job:worker/task:1/device:CPU:0"],
        None, None, None, num_workers=2, worker_index=1, is_chief=False))
    self.assertEqual(lines["Worker"], "1 of 2, synchronous replicas")
    self.assertEqual(lines["Batch size"],
                     "32 per tower, 32 per step, 64 per step of all 2 "
                     "workers")
    self.assertEqual(lines["Steps"],
                     "from the chief's checkpoint, if any, to step 100")

  def testTheLastLineOfARunThatRanNoStep(self):
    self.assertEqual(
        run_story.summary_line({"global_step": 60, "exit_reason":
                                "max_steps", "steps_this_run": 0,
                                "wall_seconds": 1.25}, "/tmp/d"),
        "run ended at step 60 (max_steps): no step run, wall 1.2 s; run "
        "summary: /tmp/d/run_summary.json")

  def testTheLastLineNamesTowersLeftOut(self):
    summary = {"global_step": 20, "exit_reason": "max_steps",
               "steps_this_run": 20, "applied_steps": 20, "skipped_steps": 0,
               "skips_by_reason": {"nonfinite": 0},
               "rejected_by_tower": [0, 3], "final_loss": 1.5,
               "examples_per_sec": None, "wall_seconds": 4.0}
    line = run_story.summary_line(summary)
    self.assertIn("20 steps run, applied 20", line)
    self.assertIn("skipped 0, towers left out 3 (by tower [0, 3])", line)
    self.assertIn("total examples/sec -", line)
    self.assertTrue(line.endswith("run summary: written by the chief"), line)

  def testAClusterWorkersLastLineCountsItsOwnSteps(self):
    line = run_story.summary_line(
        {"global_step": 5, "exit_reason": "max_steps", "steps_this_run": 4,
         "applied_steps": 5, "skipped_steps": 0, "final_loss": 2.0,
         "examples_per_sec": 7.5, "wall_seconds": 9.7,
         "cluster": {"num_workers": 2}}, "/tmp/d")
    self.assertIn("(max_steps): 4 steps run by this worker, applied 5", line)


class _Criterion(object):

  def __init__(self, reason, dry_run=False):
    self.reason, self.dry_run = reason, dry_run


def _Params(**changes):  # pylint: disable=invalid-name
  from tf1_safe_train.trainer.config import params as params_lib  # pylint: disable=g-import-not-at-top
  return params_lib.TrainParams(train_dir="/tmp/x", max_steps=100).replace(
      **changes)


if __name__ == "__main__":
  tf.test.main()
