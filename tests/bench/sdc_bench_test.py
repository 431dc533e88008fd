"""`//bench:sdc`'s parts: its fault schedule, one detection run, its tables.

The detection run is smaller than `--quick` (small_cnn, 12 clean steps, the
spike criterion warm after 8, two faults of two kinds): what it proves does
not depend on the sizes; `--quick` is `run` of `quick_config()`, checked
valid here.
"""

import tempfile

import tensorflow as tf

from bench import sdc_lib
from tf1_safe_train.trainer.drills import injection


class SdcBenchTest(tf.test.TestCase):

  def testQuickConfigIsValidAndSmaller(self):
    quick = sdc_lib.quick_config()  # Validated.
    self.assertLess(quick.faults_per_kind, sdc_lib.SdcConfig().faults_per_kind)
    self.assertEqual(4, quick.num_towers)

  def testFaultSpecHitsOneTowerEveryOtherStepKindsAndTowersInTurn(self):
    config = sdc_lib.SdcConfig(kinds=("bitflip30", "scale10", "stale"),
                               faults_per_kind=9).validate()
    rules = injection.parse_spec(sdc_lib.fault_spec(config, 50))
    hits = {}
    for step in range(0, 50 + 2 * 3 * 9 + 20):
      fired = [(t, r.kind) for t in range(4)
               for r in injection.active_rules(rules, step, t)]
      self.assertLessEqual(len(fired), 1)
      if fired:
        self.assertEqual(0, (step - 50) % 2)
        hits[step] = fired[0]
    self.assertEqual(27, len(hits))
    self.assertEqual([50, 102], [min(hits), max(hits)])
    # Kinds in turn; a round of kinds per tower, towers in turn.
    self.assertEqual([(0, "bitflip30"), (0, "scale10"), (0, "stale"),
                      (1, "bitflip30")], [hits[s] for s in (50, 52, 54, 56)])
    for kind in config.kinds:
      self.assertEqual(9, sum(k == kind for _, k in hits.values()))

  def testDetectCatchesABigFaultOnlyAndMeasuresHowFarEachMoved(self):
    config = sdc_lib.SdcConfig(
        models=("small_cnn",), clean_steps=(12,), precision_steps=(1,),
        batch_size=2, faults_per_kind=2, kinds=("scale100", "bitflip22"),
        eval_examples=1).validate()
    # Both criteria in one run, each in its dry run, side by side.
    result = sdc_lib.detect(config, 0, (
        sdc_lib.DETECTIONS[0],
        sdc_lib.Detection("spike", (("skip_spikes_sigma", 6.0),
                                    ("spike_warmup_steps", 8)),
                          "spike", "spike_dry_run"),
        sdc_lib.Detection("tower_outliers", (
            ("skip_tower_outliers", 6.0),
            ("skip_tower_outliers_warmup_steps", 8)),
                          "tower_outlier", "skip_tower_outliers_dry_run")))
    self.assertEqual(["spike", "tower_outliers"], sorted(result))
    for name in result:
      self.assertEqual((0, 12), (result[name]["false_positives"],
                                 result[name]["clean_steps"]), name)
      faults = result[name]["faults"]
      scaled, flipped = faults["scale100"], faults["bitflip22"]
      # (The tower-agreement criterion's catch names the faulted tower.)
      self.assertEqual([True, True], [caught for caught, _ in scaled], name)
      # One tower in 4 times 100: the average moves by about 99/4 times
      # the tower's share; the lowest exponent bit's neighbour moves one
      # element.
      self.assertTrue(all(move > 10 for _, move in scaled), scaled)
      self.assertEqual([False, False], [caught for caught, _ in flipped])
      self.assertTrue(all(0 < move < 0.1 for _, move in flipped), flipped)
    # The same faults, measured once.
    self.assertEqual([m for _, m in result["spike"]["faults"]["scale100"]],
                     [m for _, m in
                      result["tower_outliers"]["faults"]["scale100"]])

  def testPrecisionRunEvaluatesItsOwnModel(self):
    # Before: evaluated as small_cnn, resnet8's checkpoint failed to load
    # ("Key small_cnn/conv1/biases not found in checkpoint").
    config = sdc_lib.SdcConfig(
        models=("resnet8",), clean_steps=(1,), precision_steps=(2,),
        num_towers=1, batch_size=2, eval_examples=2).validate()
    with tempfile.TemporaryDirectory() as root:
      result = sdc_lib.precision(config, 0, (), root)
    self.assertEqual("", result["drill"])  # No hundredth step: no fault.
    self.assertBetween(result["precision_at_1"], 0.0, 1.0)

  def testTablesSayWhatIsNotInThisBuild(self):
    self.assertEqual([], sdc_lib.missing_params(
        (("skip_spikes_sigma", 6.0),)))
    self.assertEqual(["skip_future"], sdc_lib.missing_params(
        (("skip_future", 1.0), ("batch_size", 4))))
    cost = {"executed_nodes": 10, "time_ratio": 1.0,
            "time_ratio_ci95": [1.0, 1.0]}
    results = {"models": [{"model": "m", "cost": {
        "off": cost, "spike": cost, sdc_lib.CONTROL: cost},
                           "detections": {
        "off": {"precision": {"precision_at_1": None, "wrecked": True}},
        "spike": {"precision": {"precision_at_1": 0.7},
                  "false_positives": 1, "clean_steps": 9,
                  "faults": {"scale10": [[True, 2.0], [False, 0.01]],
                             "bitflip30": [[True, float("inf")]]}}}}],
               "not_in_this_build": {"tower_outliers": ["skip_future"]}}
    table = sdc_lib.markdown(results)
    self.assertIn("| m | bitflip30 | 1/1 | 1/1 | inf | 1/1 | 1/1 |", table)
    self.assertIn("| m | scale10 | 0/2 | 1/2 | 1 | 1/2 | 1/1 |", table)
    self.assertIn("| m | spike | 1/9 | 10 |", table)
    # A precision run whose model a flip wrecked (its evaluation refuses
    # a NaN loss; the bench stopped on it before).
    self.assertIn("| m | off | - | 10 | 1.000 [1.000, 1.000] | wrecked (NaN "
                  "loss) |", table)
    self.assertEqual(
        "tower_outliers: not in this build (no param skip_future)",
        table.splitlines()[-1])

  def testBadConfigIsRefused(self):
    with self.assertRaisesRegex(ValueError, "kinds must be finite"):
      sdc_lib.SdcConfig(kinds=("nan",)).validate()
    with self.assertRaisesRegex(ValueError, "clean_steps must give each"):
      sdc_lib.SdcConfig(clean_steps=(5,)).validate()


if __name__ == "__main__":
  tf.test.main()
