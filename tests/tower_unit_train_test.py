"""--skip_unit=tower through the runner (`train_lib.train`, in process).

The log line, the run summary's `rejected_by_tower`, the skips.jsonl record
of the left-out tower (`"unit": "tower"`), the optional counters in old
checkpoints, and the refusal in a cluster.
"""

import os
import tempfile

from absl import logging
from absl.testing import absltest
import tensorflow as tf

from tests import forensics_test_util
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import replication
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer import params as params_lib
from tf1_safe_train.trainer import train_lib


def _params(train_dir, **overrides):
  values = dict(num_towers=4, batch_size=2, max_steps=4, skip_unit="tower",
                inject_nonfinite="nan@2:1", save_checkpoints_steps=2)
  values.update(overrides)
  return forensics_test_util.params(train_dir, **values)


class TowerUnitTrainTest(tf.test.TestCase):

  def testLeftOutTowerIsLoggedCountedAndRecorded(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    with self.assertLogs(level="WARNING") as logs:
      summary = train_lib.train(_params(train_dir))
    self.assertIn("step 2: tower 1 (/device:CPU:1) left out: non-finite "
                  "gradients; applied 3 of 4 towers",
                  "\n".join(logs.output))
    self.assertEqual((4, 0), (summary["applied_steps"],
                              summary["skipped_steps"]))
    self.assertEqual([0, 1, 0, 0], summary["rejected_by_tower"])
    records = skip_log.read(skip_log.path(train_dir, 0))
    self.assertLen(records, 1)
    record = records[0]
    self.assertEqual((2, "tower", "after the step"),
                     (record["step"], record["unit"], record["weights"]))
    self.assertEqual([False, True, False, False],
                     [t["nonfinite"] for t in record["towers"]])
    # A grads drill does not reproduce: a device, never the data.
    self.assertFalse(record["reproduced"])
    self.assertFalse(record["exclude"])
    self.assertEqual("/device:CPU:1", record["suspect_device"])

  def testResumesFromACheckpointWithoutTheCounters(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    train_lib.train(_params(train_dir, skip_unit="step", inject_nonfinite="",
                            max_steps=2))
    summary = train_lib.train(_params(train_dir, inject_nonfinite="nan@3:2"))
    self.assertEqual([0, 0, 1, 0], summary["rejected_by_tower"])
    self.assertEqual(4, summary["applied_steps"])

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
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    with self.assertLogs(level="WARNING") as logs:
      summary = train_lib.train(_params(
          train_dir, max_steps=2, max_explained_skips=0,
          inject_nonfinite="nan@1:1,nan@1:2", min_healthy_towers=3))
    self.assertIn("step 1: 2 of 4 towers healthy, fewer than "
                  "--min_healthy_towers=3: the whole step is skipped",
                  "\n".join(logs.output))
    self.assertEqual((1, 1), (summary["applied_steps"],
                              summary["skipped_steps"]))
    self.assertEqual([0, 0, 0, 0], summary["rejected_by_tower"])

  def testMinHealthyTowersIsValidated(self):
    with self.assertRaisesRegex(params_lib.ParamsError,
                                r"--min_healthy_towers=5: must be an integer "
                                r"in \[0, --num_towers=4\]"):
      _params("/tmp/unused", min_healthy_towers=5)
    with self.assertRaisesRegex(params_lib.ParamsError, "--skip_unit='x'"):
      _params("/tmp/unused", skip_unit="x")


if __name__ == "__main__":
  absltest.main()
