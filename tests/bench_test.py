"""The benchmarks keep running: `guard_overhead --quick` end to end, towers.

These check the structure of what the benchmarks report, never the speed.
"""

import json
import os
import subprocess
import sys

from absl import flags
import tensorflow as tf

from bench import guard_overhead_lib
from bench import towers_lib


def _binary(name):
  """The Bazel-built binary when run by `bazel test`, else the module."""
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    path = os.path.join(srcdir, os.environ["TEST_WORKSPACE"], "bench", name)
    if os.path.exists(path):
      return [path]
  return [sys.executable, "-m", "bench." + name]


class GuardOverheadTest(tf.test.TestCase):

  def testQuickRunReportsEveryVariantWithRatiosAndMemory(self):
    json_out = os.path.join(self.get_temp_dir(), "guard_overhead.json")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        _binary("guard_overhead") + ["--quick", "--json_out=" + json_out],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    self.assertEqual(0, result.returncode, result.stderr[-3000:])
    with open(json_out) as f:
      results = json.load(f)

    self.assertEqual("plain", results["baseline"])
    self.assertEqual(["small_cnn", "resnet20"], list(results["models"]))
    for model, variants in results["models"].items():
      # --quick times no A/A control: exactly the five variants, in order.
      self.assertEqual(list(guard_overhead_lib.VARIANTS), list(variants))
      self.assertEqual(1.0, variants["plain"]["ratio_to_baseline"])
      for name, s in variants.items():
        where = (model, name)
        self.assertEqual(guard_overhead_lib.LABELS[name], s["label"])
        self.assertEqual(3, s["blocks"], where)
        self.assertGreater(s["steps_per_sec_min"], 0, where)
        self.assertLessEqual(s["steps_per_sec_min"],
                             s["steps_per_sec_median"], where)
        self.assertLessEqual(s["steps_per_sec_median"],
                             s["steps_per_sec_max"], where)
        self.assertGreater(s["ratio_to_baseline"], 0, where)
        self.assertGreater(s["cpu_ratio_to_baseline"], 0, where)
        low, high = s["ratio_ci95"]
        self.assertLessEqual(low, high, where)
        # Measured on good steps only: the guarded variants applied them all.
        if name == "plain":
          self.assertIsNone(s["all_steps_applied"], where)
        else:
          self.assertTrue(s["all_steps_applied"], where)
        # --quick probes the first model's memory only.
        if model == "small_cnn":
          self.assertGreater(s["peak_rss_mib"], 0, where)
          self.assertGreater(s["start_rss_mib"], 0, where)
        else:
          self.assertIsNone(s["peak_rss_mib"], where)

    self.assertEqual(16, results["config"]["batch_size"])
    self.assertGreater(results["machine"]["cpu_count"], 0)
    # The table went to stdout: a header and one row per model and variant.
    rows = [line for line in result.stdout.splitlines()
            if line.startswith("| small_cnn |") or
            line.startswith("| resnet20 |")]
    self.assertLen(rows, 10)

  def testRejectsAnUnknownModelInOneLine(self):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        _binary("guard_overhead") + ["--models=vgg16", "--json_out="],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    self.assertNotEqual(0, result.returncode)
    self.assertNotIn("Traceback", result.stderr)
    self.assertIn("guard_overhead: error: unknown model 'vgg16'",
                  result.stderr)


class FlagDefaultsTest(tf.test.TestCase):
  """Flag defaults equal the configs' (written twice: flags come first)."""

  def testGuardOverheadFlagsDefaultToBenchConfig(self):
    # pylint: disable=g-import-not-at-top,protected-access
    from bench import guard_overhead
    config = guard_overhead_lib.BenchConfig()
    for name in guard_overhead._CONFIG_FLAGS:
      default = flags.FLAGS[name].default
      if isinstance(default, list):
        default = tuple(default)
      self.assertEqual(getattr(config, name), default, name)

  def testTowersFlagsDefaultToTowersConfig(self):
    # In a process of its own: its flags share names with guard_overhead's.
    code = "\n".join([
        "from absl import flags",
        "from bench import towers, towers_lib",
        "config = towers_lib.TowersConfig()",
        "f = flags.FLAGS",
        "f(['towers'])",
        "assert towers.make_config(f, towers_lib) == config, (",
        "    towers.make_config(f, towers_lib), config)",
    ])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, env=env, timeout=300, check=False)
    self.assertEqual(0, result.returncode, result.stderr[-2000:])


class TowersTest(tf.test.TestCase):

  def testReportsExamplesPerSecondPerTowerCountAndInputAlone(self):
    results = towers_lib.run(
        towers_lib.TowersConfig(model="small_cnn", batch_size=4,
                                num_towers=(1, 2), warmup_steps=1, rounds=2,
                                steps_per_block=1),
        log_fn=lambda unused_line: None)
    self.assertEqual(["towers_1", "towers_2", "input_only"],
                     list(results["results"]))
    per_step = {name: r["examples_per_step"]
                for name, r in results["results"].items()}
    self.assertEqual({"towers_1": 4, "towers_2": 8, "input_only": 8},
                     per_step)
    for name, r in results["results"].items():
      self.assertGreater(r["examples_per_sec_min"], 0, name)
      self.assertLessEqual(r["examples_per_sec_min"],
                           r["examples_per_sec_median"], name)
      self.assertLessEqual(r["examples_per_sec_median"],
                           r["examples_per_sec_max"], name)
      self.assertGreater(r["ratio_to_first"], 0, name)
    self.assertEqual(1.0, results["results"]["towers_1"]["ratio_to_first"])
    table = towers_lib.markdown(results)
    self.assertIn("| trainer, 2 tower(s) |", table)
    self.assertIn("| input pipeline alone (no training) |", table)

  def testRejectsDuplicateTowerCounts(self):
    with self.assertRaisesRegex(ValueError, "duplicates"):
      towers_lib.TowersConfig(num_towers=(1, 1)).validate()


if __name__ == "__main__":
  tf.test.main()
