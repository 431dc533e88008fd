"""A tower --skip_tower_outliers leaves out, replayed: the data or the device.

Through the trainer (`train_lib.train`, what `//:train` runs), 4 CPU towers,
--skip_unit=tower: the same finite fault, tower 2's scale by 10, fed as
input (the stored batch carries it: it reproduces on another device) is the
data, its examples named and excluded, never counted toward the
quarantine; injected into tower 2's gradients (the device's: a replay
feeds it inactive) it does not reproduce, and tower 2 is quarantined
after --quarantine_after such faults. The band and the verdict's rule
are checked on numbers.
"""

import json
import math
import os
import tempfile

import tensorflow as tf

from tests.fixtures import forensics_params
from tests.fixtures import run_logs
from tf1_safe_train.core import skip_log
from tf1_safe_train.core import tower_outliers
from tf1_safe_train.trainer.explain import offline_replay
from tf1_safe_train.trainer.explain import outlier_replay
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.inputs import exclusion
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.tower import quarantine

tf1 = tf.compat.v1

# Tower 2 scaled by 10 after the criterion's warm-up (6 applied steps).
_INPUT_STEP = 7
_GRADS_STEPS = (7, 9)


def _params(train_dir, **overrides):
  values = dict(num_towers=4, batch_size=8, skip_unit="tower",
                skip_tower_outliers=6.0, skip_tower_outliers_warmup_steps=6,
                quarantine_after=2)
  values.update(overrides)
  return forensics_params.params(train_dir, **values)


def _suspect_faults(train_dir):
  reader = tf1.train.load_checkpoint(tf1.train.latest_checkpoint(train_dir))
  return reader.get_tensor(quarantine.FAULTS).tolist()


def _quarantined(train_dir):
  path = os.path.join(train_dir, quarantine.RECORD)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)["towers"]


class OutlierVerdictTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    cls.input_dir = os.path.join(root, "input")
    with run_logs.capture(level="WARNING") as logs:
      cls.input_summary = train_lib.train(_params(
          cls.input_dir, max_steps=_INPUT_STEP + 1, inject_into="input",
          inject_nonfinite="scale10@%d:2" % _INPUT_STEP))
    cls.input_logs = "\n".join(logs.output)
    cls.grads_dir = os.path.join(root, "grads")
    with run_logs.capture(level="WARNING") as logs:
      cls.grads_summary = train_lib.train(_params(
          cls.grads_dir, max_steps=_GRADS_STEPS[-1] + 2, inject_into="grads",
          inject_nonfinite=",".join("scale10@%d:2" % s
                                    for s in _GRADS_STEPS)))
    cls.grads_logs = "\n".join(logs.output)

  def testInputOutlierIsTheDataItsExamplesNamedAndExcluded(self):
    records = skip_log.read_all(self.input_dir)
    self.assertEqual([_INPUT_STEP], [r["step"] for r in records])
    record = records[0]
    self.assertEqual(tower_outliers.REASON, record["reason"])
    self.assertEqual(replay_lib.REPRODUCIBLE, record["verdict"])
    self.assertTrue(record["reproduced"])
    self.assertTrue(record["exclude"])
    self.assertIsNone(record["suspect_device"])
    replayed = record["replay"]
    self.assertEqual((2, 3, "/device:CPU:3"), (
        replayed["tower"], replayed["on_tower"], replayed["on_device"]))
    self.assertGreater(replayed["ratio"], replayed["band"][1])
    self.assertEqual(["0", "1", "3"], sorted(replayed["other_norms"]))
    # The other batches agree, by the same statistic.
    self.assertTrue(all(r <= replayed["band"][1]
                        for r in replayed["other_ratios"].values()), replayed)
    # Replayed on the weights the applied step (towers 0, 1, 3) wrote.
    self.assertEqual("after the step", record["weights"])
    ids = [t for t in record["towers"] if t["index"] == 2][0]["example_ids"]
    line = "step %d tower 2: batch (examples [%s]) replayed on tower 3 " % (
        _INPUT_STEP, ", ".join("train#%d" % i for i in ids))
    self.assertIn(line, self.input_logs)
    self.assertRegex(self.input_logs, r"x what the other towers make of its "
                     r"batch \(band up to [0-9.]+x\); reproducible: the data")
    dropped, summary = exclusion.excluded(self.input_dir)
    self.assertEqual(sorted(ids), dropped)
    self.assertEqual({"reproducible_batch": len(ids)}, summary["by_reason"])

  def testReplayedAfterTheRunAlikeByReplayBinarysLibrary(self):
    record, explained, line = offline_replay.replay_recorded(
        self.input_dir, _INPUT_STEP)
    self.assertEqual(record["verdict"], explained["verdict"])
    # The saved state is the one the run's replay saw: the same norms.
    self.assertAllClose(record["replay"]["grad_norm"],
                        explained["replay"]["grad_norm"], rtol=1e-4)
    self.assertStartsWith(line, "step %d tower 2: batch (examples [" %
                          _INPUT_STEP)

  def testInputOutlierIsNeverCountedTowardTheQuarantine(self):
    forensics = self.input_summary["forensics"]
    self.assertEqual({"reproducible": 1}, forensics["verdicts"])
    self.assertEqual({}, forensics["suspect_devices"])
    self.assertEqual([0, 0, 0, 0], _suspect_faults(self.input_dir))
    self.assertEqual([], _quarantined(self.input_dir))
    self.assertEqual([0, 0, 1, 0], self.input_summary["rejected_by_tower"])

  def testGradsOutlierIsTheDeviceQuarantinedAfterTwo(self):
    records = skip_log.read_all(self.grads_dir)
    self.assertEqual(list(_GRADS_STEPS), [r["step"] for r in records])
    for record in records:
      self.assertEqual(replay_lib.NOT_REPRODUCIBLE % "/device:CPU:2",
                       record["verdict"])
      self.assertEqual("/device:CPU:2", record["suspect_device"])
      self.assertFalse(record["exclude"])
      low, high = record["replay"]["band"]
      self.assertBetween(record["replay"]["ratio"], low, high)
      self.assertIn("step %d tower 2: batch (examples [" % record["step"],
                    self.grads_logs)
    self.assertRegex(self.grads_logs, r"\(band up to [0-9.]+x\); not "
                     r"reproducible: suspect /device:CPU:2")
    self.assertIn("tower 2 (/device:CPU:2) quarantined: 2 faults that did "
                  "not reproduce on replay (--quarantine_after=2)",
                  self.grads_logs)
    self.assertEqual([2], _quarantined(self.grads_dir))
    # The same per-tower count as the non-finite suspect faults.
    self.assertEqual([0, 0, 2, 0], _suspect_faults(self.grads_dir))
    self.assertEqual({"/device:CPU:2": 2},
                     self.grads_summary["forensics"]["suspect_devices_all_runs"])
    self.assertEqual((0, []), (self.grads_summary["forensics"][
        "excluded_examples"]["count"], exclusion.excluded(self.grads_dir)[0]))


class JudgeTest(tf.test.TestCase):

  def testBandIsUpToTheUsualRatioTimesTheThreshold(self):
    config = tower_outliers.TowerOutlierConfig(6.0, min_factor=3.0)
    criterion = type("C", (), {"config": config})()
    # Ratio 10x, usually 1x, 20 sigmas: sd = ln(10) / 20, 6 sd < ln 3.
    values = {"usual": [1.0, 1.0], "ratio": [1.0, 10.0],
              "sigmas": [0.0, 20.0]}
    self.assertAllClose((0.0, 3.0),
                        outlier_replay.band(criterion, values, 1))
    values["sigmas"][1] = 2.0  # sd = ln(10) / 2: 6 sd is the width.
    width = math.exp(6 * math.log(10.0) / 2)
    self.assertAllClose((0.0, 2 * width), outlier_replay.band(
        criterion, dict(values, usual=[1.0, 2.0],
                        ratio=[1.0, 20.0]), 1))

  def testRatiosAreTheCriterionsStatistic(self):
    # Tower 1's norm is 10x what its batch explains by the others: its
    # output norm is theirs, its gradient norm 10x theirs; the shared
    # gradient (norm 0.3) is in every tower's norm.
    own = [1.0, 10.0, 1.0, 1.0]
    gauged = [(float(math.hypot(o, 0.3)), 2.0, 0.3) for o in own]
    r = outlier_replay.ratios(gauged)
    self.assertAllClose([1.0, 1.0, 1.0], [r[0], r[2], r[3]])
    self.assertAllClose(math.hypot(10.0, 0.3) / math.hypot(1.0, 0.3), r[1])
    # A batch the model fits (output norm 1000x smaller) has the shared
    # gradient's norm: no excess.
    fitted = gauged[:3] + [(0.3, 0.002, 0.3)]
    self.assertLess(outlier_replay.ratios(fitted)[3], 1.0 + 1e-6)

  def testNamedIsTheFarthestOfSeveralAndNoneOfNone(self):
    # 3 towers, tower 2 scaled: the other two's median is their mean, so
    # tower 0 (built position 0) strays too, less far.
    criterion = tower_outliers.TowerOutliers(6.0)
    criterion.outlier_towers = lambda values: [0, 3]
    values = {"usual": [1.0, 1.0, 1.0], "ratio": [0.3, 1.0, 9.0],
              "sigmas": [8.0, 0.5, 30.0]}
    tower, band = outlier_replay.named(criterion, values, [0, 1, 3])
    self.assertEqual(3, tower)
    self.assertAllClose((0.0, 3.0), band)
    criterion.outlier_towers = lambda values: []
    self.assertIsNone(outlier_replay.named(criterion, values, [0, 1, 3]))

  def testOutsideTheBandWithAgreeingOthersIsTheData(self):
    self.assertEqual(
        (replay_lib.REPRODUCIBLE, True, True),
        outlier_replay.judge(40.0, [0.8, 1.1, 1.2], (0.0, 3.0), "d")[:3])

  def testOutsideTheBandWithDisagreeingOthersExcludesNothing(self):
    self.assertEqual(
        (outlier_replay.UNDECIDED, True, False),
        outlier_replay.judge(40.0, [1.0, 4.0, 50.0], (0.0, 3.0), "d")[:3])

  def testWithinTheBandIsTheDevice(self):
    self.assertEqual(
        (replay_lib.NOT_REPRODUCIBLE % "/gpu:2", False, False),
        outlier_replay.judge(1.5, [0.8, 1.1, 1.2], (0.0, 3.0),
                             "/gpu:2")[:3])


if __name__ == "__main__":
  tf.test.main()
