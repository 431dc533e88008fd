"""Workers' skip records reach the chief's train_dir through the cluster.

One sync and one async run of a loopback cluster (1 ps thread + 2 forked
workers of //:train: tests/fixtures/loopback_cluster.py), each worker with
a --train_dir of its own (no shared file system): worker 1's skip records,
replayed and with their verdicts, are in its own directory and, through the
relay queue on the ps (`cluster/skip_relay.py`), in the chief's
`skips-worker1.jsonl`, and the chief's `run_summary.json` counts them.
Each run takes about 20 s; one run serves every assertion of its mode.
The queue itself (no duplicate in a shared directory, a full queue never
blocks a send) is tested on a ps and a worker server of this process.
"""

import json
import os
import subprocess
import tempfile
import uuid

import tensorflow as tf

from tests.fixtures import loopback_cluster
from tf1_safe_train.cluster import local_cluster_lib
from tf1_safe_train.cluster import replicas
from tf1_safe_train.cluster import skip_relay
from tf1_safe_train.core import skip_log
from tf1_safe_train.core import skip_report
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import run_summary

# Shorter than the workers' own --startup_timeout_secs (600): a hang fails.
_TIMEOUT_SECS = 180
tf1 = tf.compat.v1


class SkipRelayQueueTest(tf.test.TestCase):
  """The relay on a ps and a worker server of this process."""

  def testDrainsOnceAndNeverBlocksWhenFull(self):
    cluster = local_cluster_lib.make_cluster(num_ps=1, num_workers=1)
    params = params_lib.TrainParams(device="cpu")
    replicas.start_server(cluster.for_task("ps", 0), params)
    server = replicas.start_server(cluster, params)
    train_dir = self.get_temp_dir() + "/relay_%s" % uuid.uuid4().hex[:8]
    os.makedirs(train_dir)
    with tf.Graph().as_default():
      # 4 places, 2 workers: a send is refused from 2 records on.
      relay = skip_relay.SkipRelay(num_workers=2, capacity=4)
      with tf1.Session(server.target) as session:
        records = [skip_report.record(s, 1, "nonfinite", towers=[])
                   for s in (3, 4, 5)]
        # Shared directory: the worker appended its first record itself.
        skip_log.append(skip_log.path(train_dir, 1), records[0])
        self.assertEqual([relay.send(session, r) for r in records],
                         [True, True, False])  # Full: dropped, no wait.
        self.assertEqual(relay.dropped, 1)
        self.assertEqual(relay.drain(session, train_dir,
                                     session.run(relay.size)), 1)
        self.assertEqual(session.run(relay.size), 0)
    self.assertEqual(skip_log.read(skip_log.path(train_dir, 1)),
                     json.loads(json.dumps(records[:2])))


class SkipRelayTest(tf.test.TestCase):

  def _cluster(self, *flags):
    """Runs 2 workers, each with its own train_dir; returns the dirs and
    the chief's run summary."""
    dirs = [tempfile.mkdtemp(prefix="w%d_%s_" % (i, uuid.uuid4().hex[:8]),
                             dir=self.get_temp_dir()) for i in range(2)]
    result = loopback_cluster.run([
        "--batch_size=4", "--num_towers=1", "--device=cpu",
        "--save_summaries_steps=1000", "--save_checkpoints_steps=1000",
        "--max_consecutive_skips=0"] + list(flags), num_workers=2,
                                  timeout=_TIMEOUT_SECS,
                                  worker_flags=lambda i: ["--train_dir=" +
                                                          dirs[i]])
    for index, worker in enumerate(result.workers):
      self.assertIsInstance(worker, subprocess.CompletedProcess,
                            "worker %d: %s" % (index, worker))
      self.assertEqual(worker.returncode, 0, worker.stderr[-3000:])
    self.assertTrue(result.ps_ended, "the ps did not end with the run")
    with open(os.path.join(dirs[0], run_summary.RUN_SUMMARY)) as f:
      return dirs, json.load(f)

  def _assertRelayed(self, dirs, summary):
    """Worker 1's records, in its own directory, are the chief's copy."""
    own = skip_log.read(skip_log.path(dirs[1], 1))
    self.assertTrue(own)
    self.assertTrue(all("verdict" in r and "replay" in r for r in own), own)
    self.assertEqual(skip_log.read(skip_log.path(dirs[0], 1)), own)
    self.assertFalse(os.path.exists(skip_log.path(dirs[1], 0)))
    forensics = summary["forensics"]
    chief = len(skip_log.read(skip_log.path(dirs[0], 0)))
    self.assertEqual(forensics["all_records_by_worker"],
                     dict({"1": len(own)}, **({"0": chief} if chief else {})))
    self.assertEqual(forensics["all_records"], len(own) + chief)
    return own, forensics

  def testSyncWorkersRecordsReachTheChief(self):
    dirs, summary = self._cluster("--sync_replicas", "--max_steps=6",
                                  "--inject_nonfinite=nan@3-4:0/1")
    own, forensics = self._assertRelayed(dirs, summary)
    # Worker 1 poisoned at steps 3 and 4: at each once, twice when it ran
    # ahead and took a slower worker's turn at the same global step, or
    # not at all when a worker ahead took its turn (sync replicas' tokens;
    # the drill keys on global_step).
    self.assertContainsSubset([r["step"] for r in own], [3, 4])
    # Each replay's verdict (the injected NaN: not in the data, reproduced
    # on replay of the same weights and batch or not) counts on the chief.
    self.assertEqual(sum(forensics["all_verdicts"].values()), len(own),
                     forensics)

  def testAsyncWorkersRecordsReachTheChief(self):
    # Every step worker 1 runs is poisoned: async workers share
    # global_step, and a worker that starts late may see none of a few
    # given steps.
    dirs, summary = self._cluster("--max_steps=10",
                                  "--inject_nonfinite=nan@0-:0/1")
    own, forensics = self._assertRelayed(dirs, summary)
    # The chief's count is read at its end; worker 1 may skip after it.
    self.assertLessEqual(summary["nonfinite_skips"], len(own))
    self.assertEqual(sum(forensics["all_verdicts"].values()), len(own),
                     forensics)


if __name__ == "__main__":
  tf.test.main()
