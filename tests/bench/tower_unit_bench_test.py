"""`//bench:tower_unit`'s work runs, and shows the point.

The run is smaller than `--quick` (3 towers, 8 steps, a flaky tower half of
the time): what it proves does not depend on the sizes, and `--quick` is
`run` of `quick_config()`, whose values are checked here.
"""

import tensorflow as tf

from bench import tower_unit_lib


class TowerUnitBenchTest(tf.test.TestCase):

  def testQuickConfigIsValidAndSmaller(self):
    quick = tower_unit_lib.quick_config()  # Validated.
    self.assertLess(quick.max_steps, tower_unit_lib.TowerUnitConfig().max_steps)

  def testRunAppliesMoreExamplesInTowerMode(self):
    results = tower_unit_lib.run(
        tower_unit_lib.TowerUnitConfig(
            max_steps=8, batch_size=2, num_towers=3, flaky_tower=2,
            probability=0.5, eval_examples=10).validate(),
        log_fn=lambda _: None)
    step, tower, quarantine = results["runs"]
    self.assertEqual(("step", "tower", "tower+quarantine"),
                     (step["unit"], tower["unit"], quarantine["unit"]))
    # Quarantined after its second fault: never left out again.
    self.assertEqual((0, 2), (quarantine["skipped_steps"],
                              quarantine["rejected_towers"]))
    self.assertLess(quarantine["nodes_per_good_step"],
                    step["nodes_per_good_step"])
    # The same drill: every step skipped in step mode is applied with
    # two towers of three in tower mode.
    self.assertGreater(step["skipped_steps"], 0)
    self.assertEqual(0, tower["skipped_steps"])
    self.assertEqual(step["skipped_steps"], tower["rejected_towers"])
    self.assertGreater(tower["examples_applied"], step["examples_applied"])
    self.assertGreater(tower["nodes_per_good_step"],
                       step["nodes_per_good_step"])
    table = tower_unit_lib.markdown(results)
    self.assertLen(table.splitlines(), 5)
    self.assertIn("| tower | 8 | 0 |", table)

  def testBadConfigIsRefused(self):
    with self.assertRaisesRegex(ValueError, "flaky_tower"):
      tower_unit_lib.TowerUnitConfig(flaky_tower=4).validate()


if __name__ == "__main__":
  tf.test.main()
