"""Rollback in a sync loopback cluster (1 ps + 2 workers of //:train).

Worker 1's gradients are NaN at global steps 10-14, then from step 18 on
for good: the first streak (10-12) makes the chief roll back to
model.ckpt-5 between an aggregate's update and its tokens, both workers
train on past the window, and the second streak (18-20) finds
--max_rollbacks=1 used up: every worker gives up, none waits. Async
clusters are refused in one line (tests/e2e/reliability_rollback_test.py
RefusedTest). One cluster run (21 steps, about 40 s on 2 busy cores:
two worker processes and the ps) serves every test here.
"""

import json
import os
import re
import subprocess
import tempfile
import uuid

import numpy as np
import tensorflow as tf

from tests.fixtures import loopback_cluster
from tests.fixtures import train_dirs
from tf1_safe_train.trainer.inputs import checkpoint_rollback_window
from tf1_safe_train.trainer.recovery import state_rules
from tf1_safe_train.trainer.run import run_summary

tf1 = tf.compat.v1

# Shorter than the run's own limit (--startup_timeout_secs, 600 s): a hang
# fails the test, it does not wait on a worker that waits.
_TIMEOUT_SECS = 150
# The names a rollback keeps (history), and what differs run to run.
_KEPT = {name for rule in state_rules.RULES
         if rule.rollback.startswith(("kept", "reset")) for name in rule.names}
_NOT_MODEL = _KEPT | {"applied_steps", "nonfinite_skips"}


def _model(values):
  return {n: v for n, v in values.items() if n not in _NOT_MODEL}


class SyncRollbackTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super(SyncRollbackTest, cls).setUpClass()
    cls.train_dir = tempfile.mkdtemp(
        prefix="run_%s_" % uuid.uuid4().hex[:8], dir=tf1.test.get_temp_dir())
    cls.result = loopback_cluster.run([
        "--train_dir=" + cls.train_dir, "--batch_size=4", "--num_towers=1",
        "--device=cpu", "--save_summaries_steps=1000", "--sync_replicas",
        "--max_steps=30", "--save_checkpoints_steps=5",
        "--log_every_n_steps=1", "--on_persistent_skips=rollback",
        "--max_consecutive_skips=3", "--rollback_min_applied_steps=3",
        "--max_rollbacks=1", "--max_explained_skips=0",
        "--inject_nonfinite=nan@10-14:0/1,nan@18-:0/1"],
                                      timeout=_TIMEOUT_SECS)

  def setUp(self):
    super(SyncRollbackTest, self).setUp()
    for index, worker in enumerate(self.result.workers):
      self.assertIsInstance(worker, subprocess.CompletedProcess,
                            "worker %d: %s" % (index, worker))
    with open(os.path.join(self.train_dir, run_summary.RUN_SUMMARY)) as f:
      self.summary = json.load(f)

  def testRollsBackOnceThenGivesUpOnEveryWorkerWithoutAHang(self):
    summary = self.summary
    record, = summary["rollbacks"]
    # The chief's own batches of the window (which of steps 5-12 it ran
    # depends on timing: a worker may take another's turn).
    ids = {k: record.pop(k) for k in ("window_examples",
                                      "window_steps_without_ids")}
    self.assertEqual(record, {
        "at_step": 13, "to_step": 5, "checkpoint": "model.ckpt-5",
        "batches_skipped": 8, "data_window": [5, 12],
        "applied_steps_undone": 5, "rollbacks_left": 0,
        "learning_rate_multiplier": 1.0})
    self.assertGreater(ids["window_examples"], 0)
    (at_step, window), = checkpoint_rollback_window.excluded_ids(
        self.train_dir)
    self.assertEqual((at_step, len(window)), (13, ids["window_examples"]))
    self.assertEqual(
        [summary[k] for k in ("rollback_count", "rolled_back_steps",
                              "exit_reason", "global_step")],
        [1, 5, "too_many_consecutive_skips", 21])
    self.assertEqual(summary["rollback_refused"],
                     "no rollback: --max_rollbacks=1 used up")
    for index, worker in enumerate(self.result.workers):
      self.assertEqual(worker.returncode, 1, worker.stderr[-3000:])
      self.assertIn("gave up after 3 consecutive skipped steps at step 21",
                    worker.stderr)
    self.assertTrue(self.result.ps_ended, "the ps did not end with the run")
    log = self.result.workers[0].stderr
    self.assertLen(re.findall(r"rolled back at step 13 to model\.ckpt-5", log),
                   1)

  def testEveryWorkerTrainsOnPastTheWindow(self):
    # Steps 13 and 14 skipped (worker 1's NaN), 15-17 applied on both.
    for index, worker in enumerate(self.result.workers):
      applied = {
          int(m.group(1)): int(m.group(2)) for m in re.finditer(
              r"step (\d+)/30 .* applied (\d+)  skipped", worker.stderr)}
      self.assertEqual([applied.get(s) for s in (13, 14, 15, 16, 17)],
                       [5, 5, 6, 7, 8], "worker %d" % index)

  def testTheRestoredModelIsTheCheckpointsOnTheParameterServers(self):
    checked = train_dirs.assert_rollback_checkpoints(self, self.train_dir)
    by_step = {int(v["global_step"]): v for _, v in checked}
    restored = _model(by_step[5])
    # After the rollback (steps 13-14 skipped): model.ckpt-5's model,
    # bit for bit, though the workers pushed gradients all along.
    after = [v for v in by_step.values()
             if int(v["rollbacks"]) == 1 and int(v["applied_steps"]) == 5]
    self.assertNotEmpty(after, sorted(by_step))
    for values in after:
      for name, value in restored.items():
        self.assertTrue(np.array_equal(_model(values)[name], value), name)
    self.assertGreater(int(by_step[20]["applied_steps"]), 5)


if __name__ == "__main__":
  tf.test.main()
