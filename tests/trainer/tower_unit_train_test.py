"""--skip_unit=tower through the runner (`train_lib.train`, in process).

The log line, the run summary's `rejected_by_tower`, the skips.jsonl record
of the left-out tower (`"unit": "tower"`), the optional counters in old
checkpoints, and the refusal in a cluster.

One 3-tower run proves the runner's claims (each build of a run costs
seconds): it resumes a checkpoint written without the tower counters,
leaves tower 1 out at step 2 and skips the whole step 3, where only 1 of 3
towers is healthy. `BothReasonsTest` runs `//:train` (forked) and its
restart: a step with a NaN tower and a spike of the others (two reasons),
a whole-step skip's variables.
"""

import json
import os
import tempfile

from absl.testing import absltest
import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import run_logs
from tests.fixtures import forensics_params
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import replication
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.inputs import exclusion
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.run import train_lib


def _params(train_dir, **overrides):
  values = dict(num_towers=3, batch_size=2, max_steps=4, skip_unit="tower",
                inject_nonfinite="nan@2:1", save_checkpoints_steps=2)
  values.update(overrides)
  return forensics_params.params(train_dir, **values)


class TowerUnitTrainTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.train_dir = tempfile.mkdtemp(dir=tf.compat.v1.test.get_temp_dir())
    # A checkpoint without the tower counters: written with the step unit.
    train_lib.train(_params(cls.train_dir, skip_unit="step",
                            inject_nonfinite="", max_steps=2))
    with run_logs.capture(level="WARNING") as warnings:
      # Step 2: tower 1 left out; step 3: towers 1 and 2, too few healthy.
      # One replay (step 2's): step 3's skip is recorded, not replayed.
      cls.summary = train_lib.train(_params(
          cls.train_dir, inject_nonfinite="nan@2:1,nan@3:1,nan@3:2",
          min_healthy_towers=2, max_explained_skips=1))
    cls.log = "\n".join(r.getMessage() for r in warnings.records)

  def testLeftOutTowerIsLoggedCountedAndRecorded(self):
    self.assertIn("step 2: tower 1 (/device:CPU:1) left out: non-finite "
                  "gradients; applied 2 of 3 towers", self.log)
    # Steps 0-1 (the first run) and 2 (tower 1 left out) applied; step 3
    # skipped whole (testTooFewHealthyTowersSaySo).
    self.assertEqual((3, 1), (self.summary["applied_steps"],
                              self.summary["skipped_steps"]))
    self.assertEqual([0, 1, 0], self.summary["rejected_by_tower"])
    records = skip_log.read(skip_log.path(self.train_dir, 0))
    self.assertEqual([2, 3], [r["step"] for r in records])
    record = records[0]
    self.assertEqual((2, "tower", "after the step"),
                     (record["step"], record["unit"], record["weights"]))
    self.assertEqual([False, True, False],
                     [t["nonfinite"] for t in record["towers"]])
    # A grads drill does not reproduce: a device, never the data.
    self.assertFalse(record["reproduced"])
    self.assertFalse(record["exclude"])
    self.assertEqual("/device:CPU:1", record["suspect_device"])

  def testResumesFromACheckpointWithoutTheCounters(self):
    # The first run's checkpoint (step unit) has no tower counters; the
    # resumed run counts its left-out tower from zero and applies on.
    self.assertEqual(2, self.summary["steps_this_run"])
    self.assertEqual([0, 1, 0], self.summary["rejected_by_tower"])
    self.assertEqual(3, self.summary["applied_steps"])

  def testRefusedInAClusterInOneLine(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    cluster = cluster_flags.from_flags("127.0.0.1:1", "127.0.0.1:2",
                                       "worker", 0)
    with self.assertRaisesRegex(params_lib.ParamsError,
                                "^--skip_unit=tower runs on one machine "
                                "only: [^\n]*$"):
      params = _params(train_dir, startup_timeout_secs=2.0)
      train_lib.train(params, strategy=replication.make(params, cluster))
    self.assertEqual(os.listdir(train_dir), [])

  def testTooFewHealthyTowersSaySo(self):
    self.assertIn("step 3: 1 of 3 towers healthy, fewer than "
                  "--min_healthy_towers=2: the whole step is skipped",
                  self.log)
    self.assertEqual(1, self.summary["skipped_steps"])
    # The whole-step skip leaves no tower out: towers 1 and 2 not counted.
    self.assertEqual([0, 1, 0], self.summary["rejected_by_tower"])
    (record,) = [r for r in skip_log.read(skip_log.path(self.train_dir, 0))
                 if r["step"] == 3]
    self.assertEqual([False, True, True],
                     [t["nonfinite"] for t in record["towers"]])
    # Named as in step mode (the healthy average has no NaN to name).
    self.assertNotEmpty(record["towers"][1]["variables"])
    self.assertNotIn("variables: -", self.log)

  def testMinHealthyTowersIsValidated(self):
    with self.assertRaisesRegex(params_lib.ParamsError,
                                r"--min_healthy_towers=5: must be an integer "
                                r"in \[0, --num_towers=4\]"):
      _params("/tmp/unused", num_towers=4, min_healthy_towers=5)
    with self.assertRaisesRegex(params_lib.ParamsError, "--skip_unit='x'"):
      _params("/tmp/unused", skip_unit="x")


# Step 3: every tower's input NaN (the whole step skipped); step 15: tower
# 2's input NaN (left out) and tower 1's x 1e2, a spike of the average of
# towers 0 and 1 (a gradient norm about 3x the threshold).
_BOTH_FLAGS = ["--model=small_cnn", "--batch_size=8", "--device=cpu",
               "--num_towers=3", "--skip_unit=tower", "--skip_spikes_sigma=6",
               "--spike_warmup_steps=8", "--inject_into=input",
               "--inject_nonfinite=nan@3:0,nan@3:1,nan@3:2,nan@15:2,"
               "scale1e2@15:1", "--save_summaries_steps=1000",
               "--log_every_n_steps=1000", "--save_checkpoints_steps=1000"]


class BothReasonsTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.train_dir = tempfile.mkdtemp(dir=tf.compat.v1.test.get_temp_dir())
    cls.runs = [binaries.run("train", "--train_dir=" + cls.train_dir,
                             "--max_steps=%d" % steps, *_BOTH_FLAGS,
                             timeout=600) for steps in (16, 17)]
    cls.records = {r["step"]: r for r in skip_log.read(skip_log.path(
        cls.train_dir, 0))}

  def testRunsEnd(self):
    for run in self.runs:
      self.assertEqual(0, run.returncode, run.stderr)

  def testNanTowerAndSpikeCarryBothReasonsAndTheNanIsReplayed(self):
    record = self.records[15]
    self.assertEqual(("spike", ["nonfinite", "spike"]),
                     (record["reason"], record["reasons"]))
    self.assertGreater(record["spike"]["grad_norm"],
                       record["spike"]["grad_threshold"])
    self.assertEqual([False, False, True],
                     [t["nonfinite"] for t in record["towers"]])
    self.assertIn("small_cnn/conv1/weights", record["towers"][2]["variables"])
    # Replayed as any non-finite fault: its input holds NaN, the data.
    self.assertEqual(2, record["replay"]["tower"])
    self.assertEqual(sorted(record["towers"][2]["example_ids"]),
                     sorted(record["replay"]["input_ids"]))
    self.assertEqual((replay_lib.REPRODUCIBLE, True),
                     (record["verdict"], record["exclude"]))
    # Counted under both (step 3's record: the data too).
    with open(os.path.join(self.train_dir, "run_summary.json")) as f:
      self.assertEqual({"reproducible": 2, "spike": 1},
                       json.load(f)["forensics"]["all_verdicts"])
    log = self.runs[0].stderr
    self.assertIn("step 15: spike (finite; not replayed); tower 2: input "
                  "holds NaN/Inf", log)
    self.assertRegex(log, r"skipped step 15: spike, gradient norm \S+ > "
                     r"threshold \S+; and non-finite gradients in tower 2 "
                     r"\(/device:CPU:2\); variables: "
                     r"[^\n]*small_cnn/conv1/weights")

  def testNanExamplesOfTheSpikeStepAreNotFedAfterARestart(self):
    nan_ids = set(self.records[15]["replay"]["input_ids"])
    self.assertLen(nan_ids, 8)
    self.assertContainsSubset(nan_ids,
                              set(exclusion.excluded(self.train_dir)[0]))
    self.assertIn("not feeding 16 examples again (16 nonfinite input",
                  self.runs[1].stderr)  # Step 3's tower 0, step 15's 2.

  def testWholeStepSkipNamesItsVariables(self):
    record = self.records[3]
    self.assertEqual("nonfinite", record["reason"])
    for tower in record["towers"]:
      self.assertIn("small_cnn/conv1/weights", tower["variables"])
    self.assertRegex(self.runs[0].stderr, r"skipped step 3: non-finite "
                     r"gradients in towers 0 \S+, 1 \S+, 2 \S+; variables: "
                     r"[^\n]*small_cnn/conv1/weights")


if __name__ == "__main__":
  absltest.main()
