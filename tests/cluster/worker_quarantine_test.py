"""Worker quarantine in a loopback cluster: 3 sync workers, worker 1 flaky.

1 ps (a thread) + 3 workers of //:train (tests/fixtures/loopback_cluster.py)
with `--skip_unit=worker --quarantine_after=2`: worker 1's gradients are
poisoned at steps 3 and 5 (an in-step drill: a replay, which feeds it
inactive, is finite, so "not reproducible: suspect device"); at the second
it is quarantined, its decision recorded, and it pushes idle: the others
finish --max_steps, its steps 7.. and a poison at 8 never seen. A restart
of the cluster from that train_dir keeps it out (its poison at 14 is never
pushed). `RecordTest`: the record without a cluster (--clear_quarantine
removes it). One run of ~40-60 s per cluster on 2 cores.
"""

import json
import os
import subprocess
import tempfile
import uuid

import tensorflow as tf

from tests.fixtures import loopback_cluster
from tests.fixtures import train_dirs
from tf1_safe_train.cluster import worker_quarantine
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_dir as train_dir_lib
from tf1_safe_train.trainer.run import run_summary

# Shorter than the workers' own --startup_timeout_secs (600): a hang fails.
_TIMEOUT_SECS = 200

_FLAGS = ["--batch_size=4", "--num_towers=1", "--device=cpu",
          "--save_summaries_steps=1000", "--sync_replicas",
          "--save_checkpoints_steps=1000", "--max_explained_skips=0",
          "--max_consecutive_skips=0", "--skip_unit=worker",
          "--min_healthy_workers=1", "--quarantine_after=2"]


class WorkerQuarantineClusterTest(tf.test.TestCase):

  def _cluster(self, train_dir, *flags):
    """Runs 3 sync workers; returns (run summary, log lines)."""
    result = loopback_cluster.run(
        ["--train_dir=" + train_dir] + _FLAGS + list(flags), num_workers=3,
        timeout=_TIMEOUT_SECS)
    lines = []
    for index, worker in enumerate(result.workers):
      self.assertIsInstance(worker, subprocess.CompletedProcess,
                            "worker %d: %s" % (index, worker))
      self.assertEqual(worker.returncode, 0, worker.stderr[-3000:])
      lines += ["[worker %d] %s" % (index, l)
                for l in worker.stderr.splitlines()]
    self.assertTrue(result.ps_ended, "the ps did not end with the run")
    with open(os.path.join(train_dir, run_summary.RUN_SUMMARY)) as f:
      return json.load(f), lines

  @staticmethod
  def _matching(lines, *words):
    return [l for l in lines if all(w in l for w in words)]

  def testQuarantinedAfterTwoUnreproducedFaultsAndKeptByARestart(self):
    train_dir = tempfile.mkdtemp(prefix="run_%s_" % uuid.uuid4().hex[:8],
                                 dir=self.get_temp_dir())
    summary, lines = self._cluster(
        train_dir, "--max_steps=12",
        "--inject_nonfinite=nan@3:0/1,nan@5:0/1,nan@8:0/1")
    everything = "\n".join(lines)
    self.assertEqual(summary["global_step"], 12, everything)
    self.assertEqual(summary["skipped_steps"], 0, everything)
    self.assertEqual(summary["quarantined_workers"], [1], everything)
    self.assertEqual(len(self._matching(
        lines, "[worker 1]", "worker 1 quarantined: 2 faults that did not "
        "reproduce on replay (--quarantine_after=2)")), 1, everything)
    # Its first two faults were told and replayed, and no later poison ran.
    # (The drill keys on global_step, and sync tokens let a worker ahead
    # take a slower one's turn: worker 1 may push twice at step 3, or
    # never run at step 3: its two faults are then [3, 3] or [5, 8].)
    records = skip_log.read(skip_log.path(train_dir, 1))
    steps = [r["step"] for r in records]
    self.assertEqual(len(steps), 2, records)
    self.assertEqual(steps, sorted(steps))
    self.assertContainsSubset(steps, [3, 5, 8])
    self.assertTrue(all(r["verdict"].startswith("not reproducible")
                        for r in records), records)
    # Durable: the record, written before the line.
    with open(worker_quarantine.record_path(train_dir, 1)) as f:
      self.assertEqual(json.load(f), {"worker": 1, "faults": 2})
    # Left out, not rejected: after the decision its pushes count nowhere.
    # (A poisoned push that arrives after its step was taken is dropped by
    # the accumulators as stale: counted on no step.)
    rejected = summary["rejected_by_worker"][1]
    self.assertIn(rejected, (1, 2))
    self.assertEqual(train_dirs.nonfinite_entries(
        train_dirs.checkpoint_values(train_dir)), [])

    # A restart keeps it out (its poison at 14 never runs) ...
    summary, lines = self._cluster(
        train_dir, "--max_steps=16", "--inject_nonfinite=nan@14:0/1")
    everything = "\n".join(lines)
    self.assertEqual(summary["global_step"], 16, everything)
    self.assertEqual(summary["quarantined_workers"], [1], everything)
    self.assertEqual(len(self._matching(
        lines, "[worker 1]", "worker 1 quarantined (quarantine_worker_1.json, "
        "kept; --clear_quarantine starts over)")), 1, everything)
    self.assertEqual(summary["rejected_by_worker"][1], rejected, everything)
    # Its idle pushes, one per step, never fill a step's aggregate (the
    # step skipped: an idle worker, faster than the others, took their
    # turns before IdlePush waited for each step's update).
    self.assertEqual(summary["skipped_steps"], 0, everything)


class RecordTest(tf.test.TestCase):
  """The decision's record, without a cluster."""

  def _params(self, train_dir):
    return params_lib.TrainParams(
        train_dir=train_dir, sync_replicas=True, skip_unit="worker",
        quarantine_after=2)

  def testARecordKeepsItAndClearStartsOver(self):
    train_dir = self.get_temp_dir()
    path = worker_quarantine.record_path(train_dir, 2)
    with open(path, "w") as f:
      json.dump({"worker": 2, "faults": 2}, f)
    kept = worker_quarantine.WorkerQuarantine(
        self._params(train_dir), 3, 2, 2, clear=False)
    self.assertTrue(kept.quarantined)
    cleared = worker_quarantine.WorkerQuarantine(
        self._params(train_dir), 3, 2, 2, clear=True)
    self.assertFalse(cleared.quarantined)
    self.assertFalse(os.path.exists(path))
    # Another worker's record is not this one's.
    self.assertFalse(worker_quarantine.WorkerQuarantine(
        self._params(train_dir), 3, 1, 2, clear=False).quarantined)

  def testABadRecordIsOneClearError(self):
    train_dir = self.get_temp_dir()
    with open(worker_quarantine.record_path(train_dir, 1), "w") as f:
      f.write("{not json")
    with self.assertRaisesRegex(train_dir_lib.TrainDirError,
                                "not a worker quarantine record.*"
                                "--clear_quarantine starts over"):
      worker_quarantine.WorkerQuarantine(self._params(train_dir), 3, 1, 2,
                                         clear=False)


if __name__ == "__main__":
  tf.test.main()
