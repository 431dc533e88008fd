"""`//bench:spikes`'s work runs, and its drill shows the point.

The run is smaller than `--quick` (16 steps, warm-up 8, the spike at step
12, one tower): what it proves does not depend on the sizes, and `--quick`
is `run` of `quick_config()`, checked valid here.
"""

import tensorflow as tf

from bench import spikes_lib


class SpikesBenchTest(tf.test.TestCase):

  def testQuickConfigIsValidAndSmaller(self):
    quick = spikes_lib.quick_config()  # Validated.
    self.assertLess(quick.max_steps, spikes_lib.SpikesConfig().max_steps)

  def testRunSkipsTheDrillOnlyWithTheOption(self):
    config = spikes_lib.SpikesConfig(
        # One tower (the preset's two): the claims are not about towers.
        seeds=(0,), max_steps=16, batch_size=4, num_towers=1,
        drill_steps=(12,), scales=("1e4",), warmup_steps=8,
        eval_examples=50).validate()
    results = spikes_lib.run(config, log_fn=lambda _: None)
    cases = {(c["name"], c["sigma"]): c["runs"][0] for c in results["cases"]}
    self.assertEqual(sorted(cases), [("scale1e4", 0.0), ("scale1e4", 6.0),
                                     ("undisturbed", 0.0)])
    self.assertEqual(cases[("scale1e4", 6.0)]["spike_skips"], 1)
    self.assertEqual(cases[("scale1e4", 0.0)]["spike_skips"], 0)
    # Applied, a 1e4 spike wrecks the run; skipped, it changes nothing.
    self.assertGreater(cases[("scale1e4", 0.0)]["test_loss"],
                       10 * cases[("undisturbed", 0.0)]["test_loss"])
    table = spikes_lib.markdown(results)
    self.assertLen(table.splitlines(), 5)
    self.assertEqual(cases[("scale1e4", 6.0)]["exit_reason"], "max_steps")
    self.assertIn("| scale1e4 | 6 |", table)

  def testBadConfigIsRefused(self):
    with self.assertRaisesRegex(ValueError, "drill_steps"):
      spikes_lib.SpikesConfig(max_steps=10, drill_steps=(10,)).validate()


if __name__ == "__main__":
  tf.test.main()
