"""The worker unit in a loopback cluster: 3 sync workers, one poisoned.

1 ps (a thread) + 3 workers of //:train (forked: tests/fixtures/
loopback_cluster.py). With `--skip_unit=worker`, a step whose worker 1 is
poisoned is applied with the healthy pushes, as a rule workers 0 and 2
(the chief's line says so, worker 1's names itself, `rejected_by_worker`
counts it), and a step whose three workers are poisoned is skipped.
Without the unit the poisoned step is skipped for everybody, as before.
(That the applied average is bit for bit the healthy workers' is
`worker_unit_test`'s, on the same code in one process.) Each run takes
30-50 s of 3 TensorFlow processes on 2 cores: the shortest cluster that
has a poisoned step after the first steps' turns settle.
"""

import json
import os
import subprocess
import tempfile
import uuid

import tensorflow as tf

from tests.fixtures import event_files
from tests.fixtures import loopback_cluster
from tests.fixtures import train_dirs
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.run import run_summary

# Shorter than the workers' own --startup_timeout_secs (600): a hang fails.
_TIMEOUT_SECS = 180


class WorkerUnitClusterTest(tf.test.TestCase):

  def _cluster(self, *flags):
    """Runs 3 sync workers; returns (train_dir, run summary, log lines)."""
    train_dir = tempfile.mkdtemp(prefix="run_%s_" % uuid.uuid4().hex[:8],
                                 dir=self.get_temp_dir())
    result = loopback_cluster.run([
        "--train_dir=" + train_dir, "--batch_size=4", "--num_towers=1",
        "--device=cpu", "--save_summaries_steps=1000", "--sync_replicas",
        "--save_checkpoints_steps=1000", "--max_explained_skips=0",
        "--max_consecutive_skips=0"] + list(flags), num_workers=3,
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
      return train_dir, json.load(f), lines

  @staticmethod
  def _matching(lines, *words):
    return [l for l in lines if all(w in l for w in words)]

  def testLeavesOutThePoisonedWorkerAndSkipsWhenAllAre(self):
    # --min_healthy_workers=1: TF's sync protocol lets a worker that is
    # ahead take a slower one's turn (docs/several_machines.md, restarts),
    # so under load worker 1 may push twice into step 5 (it did: 1 healthy
    # push of 3, below the default floor of 2). Step 5 is then applied with
    # the healthy pushes, whichever they are; usually workers 0 and 2.
    train_dir, summary, lines = self._cluster(
        "--skip_unit=worker", "--max_steps=9", "--min_healthy_workers=1",
        "--inject_nonfinite=nan@5:0/1,nan@7:0/0,nan@7:0/1,nan@7:0/2")
    self.assertEqual(summary["global_step"], 9)
    self.assertEqual((summary["applied_steps"], summary["skipped_steps"]),
                     (8, 1), "\n".join(lines[-40:]))
    rejected = summary["rejected_by_worker"]
    self.assertIn(rejected, ([0, 1, 0], [0, 2, 0]))
    self.assertEqual(event_files.last_scalars(train_dir,
                                              "skips/rejected_worker_"),
                     {"skips/rejected_worker_%d" % w: c
                      for w, c in enumerate(rejected)})
    self.assertEqual(len(self._matching(
        lines, "[worker 0]", "step 5: worker 1 left out; applied %d of 3 "
        "workers" % (3 - rejected[1]))), 1, "\n".join(lines))
    self.assertGreaterEqual(len(self._matching(
        lines, "[worker 1]", "worker 1 left out of step 5: non-finite")),
                            rejected[1])
    self.assertEqual(len(self._matching(
        lines, "[worker 0]", "step 7: 0 of 3 workers healthy, fewer than "
        "--min_healthy_workers=1: the whole step is skipped")), 1)
    # Worker 1's own records of its pushes: left out, not skips.
    records = skip_log.read(skip_log.path(train_dir, 1))
    self.assertEqual(sorted(set((r["step"], r["reason"], r.get("unit"))
                                for r in records)),
                     [(5, "nonfinite", "worker"), (7, "nonfinite", "worker")])
    # No NaN reached the model. (Which checkpoints exist depends on the
    # chief's turns: it saves after its own runs.)
    self.assertEqual(train_dirs.nonfinite_entries(
        train_dirs.checkpoint_values(train_dir)), [])

  def testWithoutTheUnitThePoisonedWorkerSkipsTheStep(self):
    _, summary, lines = self._cluster(
        "--max_steps=7", "--inject_nonfinite=nan@5:0/1")
    self.assertEqual((summary["applied_steps"], summary["skipped_steps"]),
                     (6, 1))
    self.assertNotIn("rejected_by_worker", summary)
    self.assertTrue(self._matching(
        lines, "[worker 1]", "skipped step 5: non-finite"))
    self.assertEqual(self._matching(lines, "left out"), [])


if __name__ == "__main__":
  tf.test.main()
