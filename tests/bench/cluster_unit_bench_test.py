"""`//bench:cluster_unit`'s work runs, and shows the point.

`run` of `quick_config()` (what `--quick` runs), on the loopback cluster of
the tests (tests/fixtures/loopback_cluster.py: workers forked from servers
that imported TensorFlow already, so the cluster costs its training, not
4 TensorFlow imports): one cluster of 3 workers, the quarantine's, ~35 s on
2 loaded cores (with the servers' start). The other two modes are flags
(checked here without a cluster) whose runs are the cluster tests':
without the unit a poisoned push skips the step for everybody
(tests/e2e/distributed_test.py, sync runs), with it the push is left out
and the step applied (tests/cluster/worker_unit_cluster_test.py). Which
mode applies more examples is the full run's table (docs/several_machines.md),
not a test. The launcher itself is proven by the tests that run it.
"""

import subprocess

import tensorflow as tf

from bench import cluster_unit_lib
from tests.fixtures import loopback_cluster

_TIMEOUT_SECS = 200  # Each worker's; below its own startup timeout (600).


def _loopback(flags, num_workers):
  result = loopback_cluster.run(flags, num_workers=num_workers,
                                timeout=_TIMEOUT_SECS)
  for index, worker in enumerate(result.workers):
    if not (isinstance(worker, subprocess.CompletedProcess) and
            worker.returncode == 0):
      raise AssertionError("worker %d: %s\n%s" % (
          index, worker, getattr(worker, "stderr", "")[-3000:]))


class ClusterUnitBenchTest(tf.test.TestCase):

  def testQuickRunLeavesOutAndQuarantinesTheFlakyWorker(self):
    config = cluster_unit_lib.quick_config()
    self.assertLess(config.max_steps,
                    cluster_unit_lib.ClusterUnitConfig().max_steps)
    self.assertEqual(config.modes, ("on+quarantine",))
    results = cluster_unit_lib.run(config, log_fn=lambda _: None,
                                   launch=_loopback)
    quarantine, = results["runs"]
    self.assertEqual(quarantine["mode"], "on+quarantine")
    # Each poisoned push is left out (no step skipped) until worker 1 is
    # quarantined; then it pushes idle to the end.
    self.assertEqual(quarantine["skipped_steps"], 0)
    self.assertEqual(quarantine["applied_steps"], config.max_steps)
    self.assertEqual([1], quarantine["quarantined_workers"])
    self.assertGreater(quarantine["idle_pushes"], 0)
    # A poisoned push that arrives after its step was taken is dropped by
    # the accumulators as stale: counted on no step.
    left_out = quarantine["pushes_left_out"]
    self.assertIn(left_out, range(1, cluster_unit_lib.QUARANTINE_AFTER + 1))
    # Healthy pushes only: fewer than every worker's every step.
    self.assertEqual(quarantine["examples_applied"], config.batch_size * (
        config.max_steps * config.num_workers - left_out -
        quarantine["idle_pushes"]))
    table = cluster_unit_lib.markdown(results)
    self.assertLen(table.splitlines(), 3)  # Header, rule, the one run.
    self.assertIn("| on+quarantine | %d | 0 | %d | %d |" % (
        config.max_steps, left_out, quarantine["idle_pushes"]), table)

  def testEachModesFlags(self):
    # What the full run's three clusters differ by (the quick run makes
    # the last one's).
    config = cluster_unit_lib.ClusterUnitConfig()
    self.assertEqual(config.modes, cluster_unit_lib.MODES)
    differ = lambda mode: [
        f for f in cluster_unit_lib.train_flags(config, mode, "/tmp/x")
        if f.startswith(("--skip_unit", "--min_healthy_workers",
                         "--quarantine_after"))]
    self.assertEqual(differ("off"), ["--skip_unit=step"])
    self.assertEqual(differ("on"), ["--skip_unit=worker",
                                    "--min_healthy_workers=1"])
    self.assertEqual(differ("on+quarantine"), [
        "--skip_unit=worker", "--min_healthy_workers=1",
        "--quarantine_after=%d" % cluster_unit_lib.QUARANTINE_AFTER])
    self.assertIn("--inject_nonfinite=nan%0.05:0/1",
                  cluster_unit_lib.train_flags(config, "off", "/tmp/x"))

  def testBadConfigIsRefused(self):
    with self.assertRaisesRegex(ValueError, "flaky_worker"):
      cluster_unit_lib.ClusterUnitConfig(flaky_worker=0).validate()
    with self.assertRaisesRegex(ValueError, "modes must be some of"):
      cluster_unit_lib.ClusterUnitConfig(modes=("off", "sometimes")).validate()
    with self.assertRaisesRegex(ValueError, "modes must be some of"):
      cluster_unit_lib.ClusterUnitConfig(modes=()).validate()


if __name__ == "__main__":
  tf.test.main()
