"""Spike skips in a loopback cluster: the chief decides on the aggregate.

One sync run of a loopback cluster (1 ps + 2 workers of //:train; the ps a
thread, the workers forked: tests/fixtures/loopback_cluster.py): worker 1's
gradients are scaled by 1e4 at one step; the aggregate's gradient-norm spike
is skipped for every replica and nothing but the counters moves. Loss spikes
are refused with --sync_replicas in one line.
"""

import json
import os
import subprocess
import tempfile
import uuid

import numpy as np
import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import loopback_cluster
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.run import run_summary

tf1 = tf.compat.v1

_TIMEOUT_SECS = 240


def _checkpoint_values(path):
  reader = tf1.train.load_checkpoint(path)
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}




class SpikesClusterTest(binaries.OneLineErrorAssertions, tf.test.TestCase):

  def _cluster(self, *flags):
    """Runs a loopback cluster; returns (its train_dir, run summary)."""
    train_dir = tempfile.mkdtemp(prefix="run_%s_" % uuid.uuid4().hex[:8],
                                 dir=self.get_temp_dir())
    result = loopback_cluster.run([
        "--train_dir=" + train_dir, "--batch_size=4", "--num_towers=1",
        "--device=cpu", "--save_summaries_steps=1000",
        "--skip_spikes_sigma=6", "--spike_warmup_steps=8"] + list(flags),
                                  timeout=_TIMEOUT_SECS)
    logs = []
    for index, worker in enumerate(result.workers):
      self.assertIsInstance(worker, subprocess.CompletedProcess,
                            "worker %d: %s" % (index, worker))
      self.assertEqual(worker.returncode, 0, worker.stderr[-3000:])
      logs.append(worker.stderr)
    self.assertTrue(result.ps_ended, "the ps did not end with the run")
    self._log = "\n".join(logs)
    with open(os.path.join(train_dir, run_summary.RUN_SUMMARY)) as f:
      return train_dir, json.load(f)

  def testSyncSkipsTheAggregatesGradientNormSpike(self):
    train_dir, summary = self._cluster(
        "--sync_replicas", "--max_steps=16", "--save_checkpoints_steps=1",
        "--inject_nonfinite=scale1e4@13/1")
    self.assertEqual(summary["global_step"], 16)
    self.assertEqual((summary["spike_skips"], summary["nonfinite_skips"]),
                     (1, 0))
    path = os.path.join(train_dir, "model.ckpt-%d")
    before, after = (_checkpoint_values(path % s) for s in (13, 14))
    changed = sorted(n for n in before
                     if not np.array_equal(before[n], after[n]))
    self.assertEqual(changed, ["consecutive_skips", "global_step",
                               "max_consecutive_skips_seen", "skipped_steps",
                               "spike_skips", "spike_stats/streak"])
    # Every worker's own gradients were finite and the spike is the
    # chief's, on the aggregate: the chief tells it where it decided it,
    # one line and one record (before, nobody did); no worker reports a
    # non-finite skip. (A one-tower worker's view was read inverted: every
    # good step logged as a non-finite skip, with a record;
    # sync_replicas._or_towers.)
    self.assertEqual([line for line in self._log.splitlines()
                      if "non-finite" in line], [])
    spikes = [line for line in self._log.splitlines()
              if "skipped step" in line]
    self.assertEqual(len(spikes), 1, spikes)
    self.assertIn("skipped step 13: spike, gradient norm", spikes[0])
    records = skip_log.read(skip_log.path(train_dir, 0))
    self.assertEqual([(r["step"], r["worker"], r["reason"], r["decided_on"])
                      for r in records], [(13, 0, "spike", "aggregate")])
    self.assertIn("spike", records[0])
    self.assertEqual(skip_log.read(skip_log.path(train_dir, 1)), [])

  def testAsyncWorkersSkipTheirOwnSpikes(self):
    # Each worker decides on its own gradients and loss; the statistics on
    # the ps learn from every worker's applied steps. Both workers spike
    # from global step 10 on (which steps each runs depends on timing).
    train_dir, summary = self._cluster(
        "--max_steps=20", "--save_checkpoints_steps=1000",
        "--skip_loss_spikes", "--spike_max_streak=1000",
        "--max_consecutive_skips=0",
        "--inject_nonfinite=scale1e4@10-/0,scale1e4@10-/1")
    self.assertGreater(summary["spike_skips"], 0)
    self.assertGreaterEqual(summary["applied_steps"], 10)
    # Every skip is a spike; none is non-finite.
    self.assertNotIn("non-finite", self._log)
    # The chief reads the shared counters while the other worker skips:
    # skips are read before spikes, which a skip counts first, so no spike
    # is ever counted as non-finite (it was, 1 or 2 of them, under load).
    self.assertEqual(summary["nonfinite_skips"], 0)
    # The last checkpoint, saved while the other worker may be between the
    # two counts of a skip (its spike counted, the skip not yet).
    values = _checkpoint_values(tf1.train.latest_checkpoint(train_dir))
    self.assertIn(values["skipped_steps"] - values["spike_skips"], (-1, 0))
    self.assertTrue(all(np.isfinite(v).all() for v in values.values()
                        if np.issubdtype(np.asarray(v).dtype, np.floating)))

  def testLossSpikesWithSyncReplicasAreRefusedInOneLine(self):
    # Refused before TensorFlow's import (param_validation): a fresh
    # process that cannot import it, no forked_python server to start.
    result = binaries.run("train", "--sync_replicas", "--skip_spikes_sigma=6",
                          "--skip_loss_spikes",
                          "--train_dir=" + self.get_temp_dir(),
                          no_tensorflow=True)
    self.assertOneLineError(
        result, "--skip_loss_spikes is not supported with --sync_replicas",
        exit_code=2)


if __name__ == "__main__":
  tf.test.main()
