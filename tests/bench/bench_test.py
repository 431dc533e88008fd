"""The benchmarks keep running: `guard_overhead` and `cost_growth` --quick
end to end (their main modules, forked: `_main_in_a_fresh_process`; each
Bazel-built binary launched for its --help), towers, and the executed-node
count they rely on.

These check the structure of what the benchmarks report, never the speed.
"""

import json
import os
import subprocess
import sys

from absl import flags
import tensorflow as tf

from bench import cost_growth_lib
from bench import cost_growth_variants
from bench import executed_ops
from bench import guard_overhead_lib
from bench import run_check_cost
from bench import towers_lib
from tests.fixtures import forked_python

tf1 = tf.compat.v1


def _binary(name):
  """The Bazel-built binary when run by `bazel test`, else the module."""
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    path = os.path.join(srcdir, os.environ["TEST_WORKSPACE"], "bench", name)
    if os.path.exists(path):
      return [path]
  return [sys.executable, "-m", "bench." + name]


def _in_a_fresh_process(code, cwd, timeout=300):
  """Runs `code` as `python -c` would, in a process forked from one that
  imported TensorFlow once (forked_python): its flags are its own."""
  return forked_python.run_shared(code, cwd, timeout=timeout)


def _main_in_a_fresh_process(name, args, cwd, timeout=300):
  """Runs bench binary `name`'s module as `python -m bench.NAME ARGS` would,
  in a forked process (forked_python: same argv, environment as a launch
  with TF_CPP_MIN_LOG_LEVEL=2, output and exit code; no TensorFlow import
  of its own, about 4 CPU s a launch). What only a launch proves (the
  Bazel launcher finds the module, its flags parse) is LaunchTest's."""
  code = "\n".join([
      "import runpy, sys",
      "sys.argv = %r" % ([name] + list(args)),
      "runpy.run_module(%r, run_name='__main__', alter_sys=True)" % (
          "bench." + name),
  ])
  return _in_a_fresh_process(code, cwd, timeout)


def tearDownModule():
  forked_python.close_shared()


class LaunchTest(tf.test.TestCase):

  def testEachBinaryStartsAndParsesItsFlags(self):
    # What the forked runs do not prove: the Bazel-built binary (its
    # launcher) finds its main module and parses its flags. --help exits
    # before TensorFlow's import.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    for name, flag in (("guard_overhead", "--[no]quick"),
                       ("cost_growth", "--[no]quick"),
                       ("towers", "--num_towers")):
      result = subprocess.run(
          _binary(name) + ["--help"], capture_output=True, text=True,
          env=env, timeout=120, check=False)
      self.assertEqual(0, result.returncode, result.stderr[-2000:])
      self.assertIn(flag, result.stdout, name)


class GuardOverheadTest(tf.test.TestCase):

  def testQuickRunReportsEveryVariantWithRatiosAndMemory(self):
    json_out = os.path.join(self.get_temp_dir(), "guard_overhead.json")
    result = _main_in_a_fresh_process(
        "guard_overhead",
        # Flags win over the preset: a smaller batch, one memory probe (the
        # preset's two are BenchConfigTest's), and resnet8 for resnet20 (its
        # n = 1 sibling: batch norm's moving statistics in every variant, a
        # third of the graph; the preset's models are BenchConfigTest's).
        ["--quick", "--batch_size=4", "--models=small_cnn,resnet8",
         "--memory_probe_variants=guarded_trainer_step",
         "--json_out=" + json_out],
        self.get_temp_dir(), timeout=600)
    self.assertEqual(0, result.returncode, result.stderr[-3000:])
    with open(json_out) as f:
      results = json.load(f)

    self.assertEqual("plain", results["baseline"])
    self.assertEqual(["small_cnn", "resnet8"], list(results["models"]))
    for model, variants in results["models"].items():
      # --quick times no A/A control: exactly the variants, in order.
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
        if name in ("plain", "skip_replay"):  # The replay is not a step.
          self.assertIsNone(s["all_steps_applied"], where)
        else:
          self.assertTrue(s["all_steps_applied"], where)
        # --quick probes the memory of the first model only (a process per
        # variant), here of its guarded trainer step.
        if model == "small_cnn" and name == "guarded_trainer_step":
          self.assertGreater(s["peak_rss_mib"], 0, where)
          self.assertGreater(s["start_rss_mib"], 0, where)
        else:
          self.assertIsNone(s["peak_rss_mib"], where)

    self.assertEqual(4, results["config"]["batch_size"])
    self.assertGreater(results["machine"]["cpu_count"], 0)
    # The first-run check's Python cost per session.run: its own rows.
    run_check = results["run_check"]
    self.assertEqual(list(run_check_cost.LABELS), list(run_check["labels"]))
    for name in run_check_cost.LABELS:
      self.assertGreater(run_check["us_per_run"][name], 0, name)
    self.assertLen([line for line in result.stdout.splitlines()
                    if line.startswith("| first-run check |")],
                   len(run_check_cost.LABELS))
    # The table went to stdout: a header and one row per model and variant.
    rows = [line for line in result.stdout.splitlines()
            if line.startswith("| small_cnn |") or
            line.startswith("| resnet8 |")]
    self.assertLen(rows, 2 * len(guard_overhead_lib.VARIANTS))

  def testRejectsAnUnknownModelInOneLine(self):
    result = _main_in_a_fresh_process(
        "guard_overhead", ["--models=vgg16", "--json_out="],
        self.get_temp_dir())
    self.assertNotEqual(0, result.returncode)
    self.assertNotIn("Traceback", result.stderr)
    self.assertIn("guard_overhead: error: unknown model 'vgg16'",
                  result.stderr)


class BenchConfigTest(tf.test.TestCase):

  def testQuickProbesThePlainAndGuardedStepsOfTheFirstModel(self):
    config = guard_overhead_lib.quick_config()
    # Both default models (the quick run's test measures resnet8 instead).
    self.assertEqual(("small_cnn", "resnet20"), config.models)
    self.assertEqual(("small_cnn",), config.memory_probe_models())
    self.assertEqual(("plain", "guarded_trainer_step"),
                     config.memory_probe_variant_names())
    full = guard_overhead_lib.BenchConfig().validate()
    self.assertEqual(guard_overhead_lib.VARIANTS,
                     full.memory_probe_variant_names())

  def testRejectsAnUnknownProbeVariant(self):
    with self.assertRaisesRegex(ValueError, "unknown variant 'fast'"):
      guard_overhead_lib.BenchConfig(memory_probe_variants=("fast",)).validate()


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
    result = _in_a_fresh_process(code, self.get_temp_dir())
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


class CostGrowthTest(tf.test.TestCase):

  def testQuickRunReportsEveryCellWithRatiosAndExecutedNodes(self):
    json_out = os.path.join(self.get_temp_dir(), "cost_growth.json")
    result = _main_in_a_fresh_process(
        # One size: every claim below is of one workload's two cells.
        "cost_growth", ["--quick", "--dense_variables=10",
                        "--json_out=" + json_out],
        self.get_temp_dir(), timeout=600)
    self.assertEqual(0, result.returncode, result.stderr[-3000:])
    with open(json_out) as f:
      results = json.load(f)

    self.assertEqual("plain", results["baseline"])
    self.assertEqual(["dense10/towers_1", "dense10/towers_2"],
                     list(results["cells"]))
    self.assertEqual([], results["skipped_cells"])
    extra = {}
    for name, cell in results["cells"].items():
      variants = cell["variants"]
      # --quick times no A/A control.
      self.assertEqual(list(cost_growth_variants.VARIANTS), list(variants))
      self.assertEqual(int(cell["workload"][len("dense"):]),
                       cell["variables"], name)
      self.assertEqual(1.0, variants["plain"]["ratio_to_baseline"])
      self.assertEqual(0, variants["plain"]["extra_executed_nodes"])
      for variant, s in variants.items():
        where = (name, variant)
        self.assertEqual(3, s["blocks"], where)
        self.assertGreater(s["ratio_to_baseline"], 0, where)
        self.assertGreater(s["cpu_ratio_to_baseline"], 0, where)
        # Two traced steps of one graph execute the same nodes.
        self.assertTrue(s["executed_nodes_stable"], where)
        self.assertGreater(s["executed_nodes"], 0, where)
        self.assertAlmostEqual(
            s["extra_executed_nodes"] / cell["variables"],
            s["extra_executed_nodes_per_variable"], msg=where)
        self.assertEqual(s["extra_executed_nodes"],
                         sum(s["extra_executed_by_op_type"].values()), where)
        if variant in ("plain", "barrier_only"):
          self.assertIsNone(s["all_steps_applied"], where)
        else:
          self.assertTrue(s["all_steps_applied"], where)
        extra[(cell["workload"], cell["num_towers"], variant)] = (
            s["extra_executed_nodes"])
    for workload in ("dense10",):
      wrapper = results["cells"][workload + "/towers_1"]["variants"][
          "skip_nonfinite_optimizer"]["extra_executed_by_op_type"]
      # Fused checks (`nonfinite.any_nonfinite`), not one per gradient.
      self.assertLess(wrapper["IsFinite"], int(workload[5:]) / 2)
      # The wrapper sees the averaged gradients only, whatever the towers.
      self.assertEqual(extra[(workload, 1, "skip_nonfinite_optimizer")],
                       extra[(workload, 2, "skip_nonfinite_optimizer")])
      for towers in (1, 2):
        # Issue 16's target: no more than TF's loss-scale optimizer.
        self.assertLessEqual(
            extra[(workload, towers, "skip_nonfinite_optimizer")],
            extra[(workload, towers, "loss_scale_optimizer")])
        # The barrier is part of every guarded step: it is their floor.
        for variant in ("skip_nonfinite_optimizer", "guarded_trainer_step"):
          self.assertLess(extra[(workload, towers, "barrier_only")],
                          extra[(workload, towers, variant)])
    rows = [line for line in result.stdout.splitlines()
            if line.startswith("| dense")]
    self.assertLen(rows, 2)

  def testRejectsBadTowerCountsInOneLine(self):
    result = _main_in_a_fresh_process(
        "cost_growth", ["--num_towers=1,two", "--json_out="],
        self.get_temp_dir())
    self.assertNotEqual(0, result.returncode)
    self.assertNotIn("Traceback", result.stderr)
    self.assertIn("cost_growth: error: --num_towers must be a list of "
                  "integers, got '1,two'", result.stderr)

  def testFlagsDefaultToGrowthConfig(self):
    # In a process of its own: its flags share names with guard_overhead's.
    code = "\n".join([
        "from absl import flags",
        "from bench import cost_growth, cost_growth_lib",
        "config = cost_growth_lib.GrowthConfig()",
        "f = flags.FLAGS",
        "f(['cost_growth'])",
        "made = cost_growth.make_config(f, cost_growth_lib)",
        "assert made == config, (made, config)",
    ])
    result = _in_a_fresh_process(code, self.get_temp_dir())
    self.assertEqual(0, result.returncode, result.stderr[-2000:])


class GrowthConfigTest(tf.test.TestCase):

  def testCellsLeaveOutDenseStacksAboveTheLimitOnly(self):
    config = cost_growth_lib.GrowthConfig(
        dense_variables=(10, 600), models=("resnet20",), num_towers=(1, 2),
        max_tower_variables=1000).validate()
    self.assertEqual([("dense10", 1), ("dense10", 2), ("dense600", 1),
                      ("resnet20", 1), ("resnet20", 2)], config.cells())
    self.assertEqual([("dense600", 2)], config.skipped_cells())

  def testRejectsBadConfigs(self):
    for fields, message in (
        (dict(models=("vgg16",)), "unknown model 'vgg16'"),
        (dict(num_towers=(1, 1)), "num_towers has duplicates"),
        (dict(dense_variables=(0,)), "dense_variables must be ints >= 1"),
        (dict(dense_variables=(), models=()), "nothing to measure"),
        (dict(dense_variables=(2000,), models=()),
         "every cell has more than max_tower_variables=1000")):
      with self.assertRaisesRegex(ValueError, message):
        cost_growth_lib.GrowthConfig(**fields).validate()

  def testTrainerStepOfAReferenceModelBuildsItsOwnModel(self):
    built = cost_growth_variants.build("guarded_trainer_step", "small_cnn", 1)
    try:
      self.assertEqual(10, built.variables)  # small_cnn's, not a dense stack
      built.session.run(built.train_op)
      self.assertTrue(built.all_steps_applied())
    finally:
      built.session.close()

  def testDenseWorkloadNames(self):
    self.assertEqual(100, cost_growth_variants.dense_variables("dense100"))
    for name in ("resnet20", "dense", "dense0", "densex"):
      self.assertIsNone(cost_growth_variants.dense_variables(name), name)


class ExecutedOpsTest(tf.test.TestCase):

  def _cond_graph(self, untaken_ops):
    """A cond taking a one-op branch; the other branch has `untaken_ops`."""
    graph = tf.Graph()
    with graph.as_default():
      x = tf1.Variable(1.0, name="x")
      go = tf1.Variable(True, name="go")

      def untaken():
        y = x.read_value()
        for _ in range(untaken_ops):
          y = y * 1.5
        return y

      out = tf.cond(go.read_value(), lambda: tf.identity(x.read_value()),
                    untaken)
      init = tf1.global_variables_initializer()
    session = tf1.Session(graph=graph)
    session.run(init)
    return session, out

  def testCountsWhatRunsNotWhatTheGraphHolds(self):
    session, out = self._cond_graph(untaken_ops=1)
    small = executed_ops.executed_nodes(session, out)
    self.assertEqual(small, executed_ops.executed_nodes(session, out))
    session, out = self._cond_graph(untaken_ops=40)
    # The untaken branch's nodes are dead: none of them executes.
    self.assertEqual(small, executed_ops.executed_nodes(session, out))

  def testEachExecutedOpCountsOnce(self):
    graph = tf.Graph()
    with graph.as_default():
      x = tf1.placeholder(tf.float32, [])
      # Seven products, all fetched: Grappler would rewrite a chain (fold
      # constant adds, fuse unary ops), and the count is of what runs.
      y = [tf.multiply(x, i + 2.0, name="product%d" % i) for i in range(7)]
    with tf1.Session(graph=graph) as session:
      traced = executed_ops.trace_run(session, y, {x: 1.0})
      names = executed_ops.executed_node_names(traced)
    self.assertEqual(sum(executed_ops.executed_by_device(traced).values()),
                     len(names))
    # Each product and its constant operand, once each.
    self.assertLen([n for n in names if n.startswith("product")], 14)
    self.assertLen(set(names), len(names))
    self.assertEqual(7, executed_ops.executed_op_types(traced)["Mul"])


if __name__ == "__main__":
  tf.test.main()
