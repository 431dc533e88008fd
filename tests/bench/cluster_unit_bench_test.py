"""`//bench:cluster_unit`'s work runs, and shows the point.

`run` of `quick_config()` (what `--quick` runs), on the loopback cluster of
the tests (tests/fixtures/loopback_cluster.py: workers forked from servers
that imported TensorFlow already, so each cluster costs its training, not
4 TensorFlow imports): three clusters of 3 workers, ~20 s each on 2 loaded
cores. The launcher itself is proven by the tests that run it.
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

  def testQuickRunAppliesMoreWithTheUnitAndQuarantines(self):
    config = cluster_unit_lib.quick_config()
    self.assertLess(config.max_steps,
                    cluster_unit_lib.ClusterUnitConfig().max_steps)
    results = cluster_unit_lib.run(config, log_fn=lambda _: None,
                                   launch=_loopback)
    off, on, quarantine = results["runs"]
    self.assertEqual(cluster_unit_lib.MODES,
                     (off["mode"], on["mode"], quarantine["mode"]))
    # The same drill: each poisoned push skips the step without the unit,
    # and is left out with it (no step skipped).
    self.assertGreater(off["skipped_steps"], 0)
    self.assertEqual((0, 0), (on["skipped_steps"],
                              quarantine["skipped_steps"]))
    self.assertGreater(on["examples_applied"], off["examples_applied"])
    self.assertEqual([1], quarantine["quarantined_workers"])
    # A poisoned push that arrives after its step was taken is dropped by
    # the accumulators as stale: counted on no step.
    left_out = quarantine["pushes_left_out"]
    self.assertIn(left_out, range(1, cluster_unit_lib.QUARANTINE_AFTER + 1))
    table = cluster_unit_lib.markdown(results)
    self.assertLen(table.splitlines(), 5)
    self.assertIn("| on+quarantine | %d | 0 | %d |" % (config.max_steps,
                                                        left_out), table)

  def testBadConfigIsRefused(self):
    with self.assertRaisesRegex(ValueError, "flaky_worker"):
      cluster_unit_lib.ClusterUnitConfig(flaky_worker=0).validate()


if __name__ == "__main__":
  tf.test.main()
