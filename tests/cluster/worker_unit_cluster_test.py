"""The worker unit in a loopback cluster: 3 sync workers, one poisoned.

1 ps (a thread) + 3 workers of //:train (forked: tests/fixtures/
loopback_cluster.py). With `--skip_unit=worker`, a step whose worker 1 is
poisoned is applied with the healthy pushes, as a rule workers 0 and 2
(the chief's line says so, worker 1's names itself, `rejected_by_worker`
counts it), and a step whose three workers are poisoned is skipped.
Without the unit the poisoned step is skipped for everybody, as before:
tests/e2e/distributed_test.py's sync runs (2 workers; the fp16 run also
checks that no worker is left out: no `rejected_by_worker`, no such line),
so this file pays for one cluster, not two.
The workers of the unit's run record each push (tests/fixtures/
push_recorder.py: its token's step, health, gradients and the weights it
read), so the weights after step 5 are checked bit for bit against a
reference that applies the average of exactly the healthy pushes step 5
summed to the weights they were computed on, whichever worker took which
turn; and step 7's skip leaves them bit for bit unchanged. (That the
aggregation is exact in every arrival order is `worker_unit_test`'s, in
one process.) The run takes 30-50 s of 3 TensorFlow processes on 2 cores:
the shortest cluster that has a poisoned step after the first steps' turns
settle.
"""

import itertools

import json
import os
import subprocess
import tempfile
import uuid

import numpy as np
import tensorflow as tf

from tests.fixtures import event_files
from tests.fixtures import loopback_cluster
from tests.fixtures import push_recorder
from tests.fixtures import train_dirs
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.run import run_summary

# Shorter than the workers' own --startup_timeout_secs (600): a hang fails.
_TIMEOUT_SECS = 180
_LR = 0.01  # --optimizer=sgd's, at --learning_rate's default.
tf1 = tf.compat.v1


def _reference(weights, grads):
  """`weights` after a plain SGD step on the sum of `grads` (summed in this
  order, as an accumulator adds its pushes) divided by their count: the
  chief's ops (`worker_unit.chief_average`, then ApplyGradientDescent)."""
  with tf.Graph().as_default(), tf1.Session() as session:
    pairs = []
    for name, value in sorted(weights.items()):
      total = tf.constant(grads[0][name])
      for grad in grads[1:]:
        total = tf.add(total, tf.constant(grad[name]))
      pairs.append((total / tf.constant(float(len(grads))),
                    tf1.Variable(value, use_resource=True)))
    apply = tf1.train.GradientDescentOptimizer(_LR).apply_gradients(pairs)
    session.run(tf1.global_variables_initializer())
    session.run(apply)
    return {name: session.run(var) for (name, _), (_, var) in zip(
        sorted(weights.items()), pairs)}


def _same(a, b):
  return sorted(a) == sorted(b) and all(
      a[k].tobytes() == b[k].tobytes() for k in a)


class WorkerUnitClusterTest(tf.test.TestCase):

  def _cluster(self, *flags, module="tf1_safe_train.train"):
    """Runs 3 sync workers; returns (train_dir, run summary, log lines)."""
    train_dir = tempfile.mkdtemp(prefix="run_%s_" % uuid.uuid4().hex[:8],
                                 dir=self.get_temp_dir())
    result = loopback_cluster.run([
        "--train_dir=" + train_dir, "--batch_size=4", "--num_towers=1",
        "--device=cpu", "--save_summaries_steps=1000", "--sync_replicas",
        "--save_checkpoints_steps=1000", "--max_explained_skips=0",
        "--max_consecutive_skips=0"] + list(flags), num_workers=3,
                                  timeout=_TIMEOUT_SECS, module=module)
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
        "--inject_nonfinite=nan@5:0/1,nan@7:0/0,nan@7:0/1,nan@7:0/2",
        "--optimizer=sgd", module=push_recorder.MODULE)
    self.assertEqual(summary["global_step"], 9)
    self.assertEqual((summary["applied_steps"], summary["skipped_steps"]),
                     (8, 1), "\n".join(lines[-40:]))
    rejected = summary["rejected_by_worker"]
    # [0, 0, 0]: worker 1's poisoned push came with a token of step 4,
    # which the others had finished: stale, dropped (the pushes show it).
    self.assertIn(rejected, ([0, 0, 0], [0, 1, 0], [0, 2, 0]))
    self.assertEqual(event_files.last_scalars(train_dir,
                                              "skips/rejected_worker_"),
                     {"skips/rejected_worker_%d" % w: c
                      for w, c in enumerate(rejected)})
    self.assertEqual(len(self._matching(
        lines, "[worker 0]", "step 5: worker 1 left out; applied %d of 3 "
        "workers" % (3 - rejected[1]))), 1 if rejected[1] else 0,
                     "\n".join(lines))
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
    self._assertStepsFromThePushes(push_recorder.load(train_dir), rejected)

  def _assertStepsFromThePushes(self, pushes, rejected):
    """Step 5 applied exactly the healthy pushes' average, step 7 nothing."""
    tagged = lambda step: [p for p in pushes if p["step"] == step]
    at5, at6 = tagged(5), tagged(6)
    # One token per push: step 5 summed exactly its 3 pushes.
    self.assertEqual(len(at5), 3, [(p["step"], p["worker"]) for p in pushes])
    left_out = [p for p in at5 if not p["health"][1].any()]
    self.assertEqual([p["worker"] for p in left_out], [1] * rejected[1])
    if not rejected[1]:  # Stale: tagged with an older step, not summed.
      self.assertTrue([p for p in pushes if p["worker"] == 1 and
                       p["step"] < 5 and not p["health"][1].any()])
    healthy = [p for p in at5 if p["health"][1].any()]
    # The weights every push of step 5 computed on, and those after it
    # (which every push of step 6 read).
    before = at5[0]["reads"]
    self.assertTrue(all(_same(p["reads"], before) for p in at5))
    after = at6[0]["reads"]
    self.assertTrue(all(_same(p["reads"], after) for p in at6))
    # Two healthy pushes: their sum is one rounding, in any order; three
    # (a worker pushed twice) follow the arrival order, not recorded: one
    # order must match.
    self.assertTrue(any(
        _same(_reference(before, [p["grads"] for p in order]), after)
        for order in itertools.permutations(healthy)),
                    "step 5 did not apply the average of workers %s" % (
                        [p["worker"] for p in healthy],))
    self.assertFalse(_same(before, after))
    # Step 7 (all three poisoned) is skipped: the weights do not move.
    self.assertTrue(_same(tagged(7)[0]["reads"], tagged(8)[0]["reads"]))


if __name__ == "__main__":
  tf.test.main()
