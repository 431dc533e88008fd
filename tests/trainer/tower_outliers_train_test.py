"""--skip_tower_outliers through the runner (`train_lib.train`, in process).

One 4-tower run with `--skip_unit=tower` and the drill `scale10@12:2`
(tower 2's gradients times 10 at step 12, after a warm-up of 10 applied
steps): its line, its skips.jsonl record, run_summary.json, TensorBoard
and the checkpoint name tower 2 and count it. And what a good step pays
for it per tower: less than the tower's non-finite check.
"""

import tempfile

import tensorflow as tf

from bench import executed_ops
from tests.fixtures import event_files
from tests.fixtures import forensics_params
from tests.fixtures import run_logs
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.step import train_step
from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1

_S = 12


class TowerOutliersTrainTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.train_dir = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    with run_logs.capture(level="WARNING") as warnings:
      cls.summary = train_lib.train(forensics_params.params(
          cls.train_dir, num_towers=4, skip_unit="tower", max_steps=_S + 2,
          skip_tower_outliers=6.0, skip_tower_outliers_warmup_steps=10,
          inject_nonfinite="scale10@%d:2" % _S, seed=1))
    cls.log = "\n".join(r.getMessage() for r in warnings.records)

  def testTheLineNamesTheTowerItsDeviceAndTheStatistic(self):
    self.assertRegex(
        self.log, r"step %d: tower 2 \(/device:CPU:2\) left out: outlier, "
        r"gradient norm [0-9.]+x what its batch explains by the other "
        r"towers \(usually [0-9.]+x\): [0-9.]+ sigma > 6, min factor 3; "
        r"applied 3 of 4 towers" % _S)
    self.assertNotIn("halves", self.log)  # No loss scale, no overflow.

  def testTheRecordNamesTheTower(self):
    (record,) = skip_log.read(skip_log.path(self.train_dir, 0))
    self.assertEqual((_S, "tower_outlier", "tower"),
                     (record["step"], record["reason"], record["unit"]))
    self.assertEqual([2], record["tower_outlier"]["towers"])
    self.assertEqual(["/device:CPU:2"], record["tower_outlier"]["devices"])
    self.assertEqual([False, False, True, False],
                     [t["outlier"] for t in record["towers"]])
    self.assertEqual([False] * 4, [t["nonfinite"] for t in record["towers"]])
    # Its gradients' drill (the device's) does not come back on replay
    # (`outlier_replay`; tests/trainer/explain/outlier_replay_test.py).
    self.assertEqual((2, "not reproducible: suspect /device:CPU:2"),
                     (record["replay"]["tower"], record["verdict"]))

  def testCountedInTheSummaryTensorBoardAndTheCheckpoint(self):
    summary = self.summary
    self.assertEqual((_S + 2, 0), (summary["applied_steps"],
                                   summary["skipped_steps"]))
    self.assertEqual([0, 0, 1, 0], summary["tower_outlier_by_tower"])
    self.assertEqual([0, 0, 1, 0], summary["rejected_by_tower"])
    self.assertEqual([0, 0, 0, 0], summary["nonfinite_steps_by_tower"])
    self.assertEqual({"/device:CPU:2": 1},
                     summary["forensics"]["suspect_devices"])
    scalars = event_files.last_scalars(self.train_dir,
                                       "skips/tower_outlier_tower_")
    self.assertEqual({"skips/tower_outlier_tower_%d" % i: float(i == 2)
                      for i in range(4)}, scalars)
    reader = tf1.train.load_checkpoint(self.train_dir)
    self.assertEqual([0, 0, 1, 0],
                     list(reader.get_tensor("tower_outlier_by_tower")))


def _executed(num_towers, sigma):
  """(executed nodes of a good step of small_cnn, and of its tower 1's
  fused non-finite check), with --skip_tower_outliers=sigma."""
  params = params_lib.TrainParams(
      num_towers=num_towers, device="cpu", batch_size=2,
      skip_tower_outliers=sigma, skip_tower_outliers_warmup_steps=1).validate()
  config = towers.TowerConfig(num_towers, "cpu")
  with tf.Graph().as_default():
    step = train_step.build_step(params,
                                 local_replication.Local(params, config))
    with tf1.Session(config=towers.session_config(config)) as sess:
      sess.run([tf1.global_variables_initializer(),
                tf1.local_variables_initializer()])
      for _ in range(3):
        sess.run(step.train_op)
      names = executed_ops.executed_node_names(
          executed_ops.trace_run(sess, step.train_op))
  return len(names), len([n for n in names if n.startswith(
      "tower_1/") and "any_nonfinite" in n])


class GoodStepCostTest(tf.test.TestCase):

  def testEachTowerCostsLessThanItsNonFiniteCheck(self):
    # Each tower's norm is read over its fused check's tensors: a cast and
    # an L2Loss per pass and a few nodes for the sum (docs/performance.md).
    counts = {(n, k): _executed(n, k) for n in (2, 4) for k in (0.0, 6.0)}
    per_tower = ((counts[4, 6.0][0] - counts[4, 0.0][0]) -
                 (counts[2, 6.0][0] - counts[2, 0.0][0])) / 2.0
    check = counts[4, 0.0][1]
    self.assertGreater(check, 0)
    self.assertLess(per_tower, check, counts)


if __name__ == "__main__":
  tf.test.main()
