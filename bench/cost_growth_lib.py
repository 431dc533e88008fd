"""The guard's cost as models and towers grow (issue 16, items 1 and 4).

For every cell of a grid (workload x tower count, see
`cost_growth_variants`) the variants of the step are built side by side,
timed round-robin in one process (see `timing`, with an A/A control) and
traced once to count the nodes each executes per step (see
`executed_ops`): the count is deterministic where the timing, on a shared
machine, is not. `run` returns everything as a JSON-able dict, `markdown`
one table row per cell.
"""

import collections
import dataclasses
import math
import time

from bench import cost_growth_variants as variants_lib
from bench import executed_ops
from bench import guard_overhead_lib
from bench import timing
from tf1_safe_train import models

BASELINE = "plain"


@dataclasses.dataclass(frozen=True)
class GrowthConfig(object):
  """What `run` measures. Fields mirror `//bench:cost_growth` flags."""
  dense_variables: tuple = (10, 100, 1000)
  models: tuple = ("small_cnn", "resnet20")
  num_towers: tuple = (1, 2, 4)
  # Graph building and Grappler take minutes beyond this (1000 dense
  # variables on 4 towers: about 80 s per variant).
  max_tower_variables: int = 1000
  warmup_steps: int = 3
  rounds: int = 20
  min_block_seconds: float = 0.05
  max_timing_seconds: float = 240.0
  aa_control: bool = True
  seed: int = 0

  def validate(self):
    """Returns self if every field is valid; raises ValueError otherwise."""
    if not self.dense_variables and not self.models:
      raise ValueError("nothing to measure: no dense_variables and no models")
    for name in self.models:
      if name not in models.MODEL_NAMES:
        raise ValueError("unknown model %r; expected one of %s" %
                         (name, ", ".join(models.MODEL_NAMES)))
    for name, values, low in (
        ("dense_variables", self.dense_variables, 1),
        ("num_towers", self.num_towers, 1),
        ("max_tower_variables", (self.max_tower_variables,), 1),
        ("warmup_steps", (self.warmup_steps,), 1),
        ("rounds", (self.rounds,), 1)):
      for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
          raise ValueError("%s must be ints >= %d, got %r" % (name, low, value))
    for name in ("dense_variables", "num_towers", "models"):
      values = getattr(self, name)
      if len(set(values)) != len(values):
        raise ValueError("%s has duplicates: %r" % (name, values))
    if not self.num_towers:
      raise ValueError("num_towers must not be empty")
    for name in ("min_block_seconds", "max_timing_seconds"):
      if not getattr(self, name) > 0:
        raise ValueError("%s must be > 0, got %r" % (name, getattr(self, name)))
    if not self.cells():
      raise ValueError("every cell has more than max_tower_variables=%d "
                       "variables x towers" % self.max_tower_variables)
    return self

  def variants(self):
    """The timed variants, in round-robin order."""
    return variants_lib.VARIANTS + (
        (variants_lib.CONTROL,) if self.aa_control else ())

  def _grid(self):
    workloads = ([variants_lib.DENSE_PREFIX + str(v)
                  for v in self.dense_variables] + list(self.models))
    return [(w, t) for w in workloads for t in self.num_towers]

  def _too_big(self, workload, num_towers):
    # Reference models are small (resnet20: 59 variables): always measured.
    size = variants_lib.dense_variables(workload)
    return size is not None and size * num_towers > self.max_tower_variables

  def cells(self):
    """The measured (workload, towers) pairs, in the table's order."""
    return [c for c in self._grid() if not self._too_big(*c)]

  def skipped_cells(self):
    """The grid's pairs left out by `max_tower_variables`."""
    return [c for c in self._grid() if self._too_big(*c)]


def quick_config(**overrides):
  """A configuration that checks everything runs, in well under a minute.

  Dense stacks of 10 and 30 variables on 1 and 2 towers, 3 rounds, no A/A
  control: the executed-node counts are exact, the ratios mean little.
  `overrides` are `GrowthConfig` fields that win over these.
  """
  quick = dict(dense_variables=(10, 30), models=(), num_towers=(1, 2),
               warmup_steps=1, rounds=3, min_block_seconds=0.01,
               aa_control=False)
  quick.update(overrides)
  return GrowthConfig(**quick).validate()


def _cell_name(workload, num_towers):
  return "%s/towers_%d" % (workload, num_towers)


def _count_nodes(built):
  """Executed nodes of a step, traced twice.

  Returns:
    (count, True if both traces agree, `collections.Counter` by op type).
  """
  traces = [executed_ops.trace_run(built.session, built.train_op)
            for _ in range(2)]
  counts = [sum(executed_ops.executed_by_device(t).values()) for t in traces]
  return (counts[0], counts[0] == counts[1],
          executed_ops.executed_op_types(traces[0]))


def _steps_per_block(step, min_seconds):
  """Steps per timed block so that a block of `step` lasts `min_seconds`."""
  times = []
  for _ in range(3):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return max(1, min(1000, math.ceil(min_seconds / max(sorted(times)[1],
                                                       1e-6))))


def measure_cell(config, workload, num_towers, max_seconds, log_fn=print):
  """Builds, counts and times every variant of one cell.

  Args:
    config: a validated `GrowthConfig`.
    workload: `dense<V>` or a model name.
    num_towers: towers.
    max_seconds: this cell's share of the timing budget.
    log_fn: callable(str) for progress lines.

  Returns:
    A dict: `workload`, `num_towers`, `variables`, `steps_per_block`,
    `build_seconds` and `variants`: name -> `timing.summarize` summary plus
    `label`, `executed_nodes` (per step), `executed_nodes_stable` (two
    traced steps agreed), `extra_executed_nodes` (minus plain's),
    `extra_executed_nodes_per_variable`, `extra_executed_by_op_type`
    (op type -> executed nodes more than plain's) and `all_steps_applied`.
  """
  name = _cell_name(workload, num_towers)
  start = time.time()
  built = collections.OrderedDict()
  try:
    for variant in config.variants():
      built[variant] = variants_lib.build(variant, workload, num_towers,
                                          config.seed)
    steps = collections.OrderedDict(
        (v, (lambda b: lambda: b.session.run(b.train_op))(b))
        for v, b in built.items())
    for step in steps.values():
      for _ in range(config.warmup_steps):
        step()
    counts = {v: _count_nodes(b) for v, b in built.items()}
    build_seconds = time.time() - start
    per_block = _steps_per_block(steps[BASELINE], config.min_block_seconds)
    log_fn("%s: built, warmed up and traced %d variants in %.1fs; up to %d "
           "rounds of %d step(s) (or %.0fs)" % (
               name, len(built), build_seconds, config.rounds, per_block,
               max_seconds))
    times = timing.round_robin(steps, config.rounds, per_block, 0,
                               seed=config.seed, max_seconds=max_seconds)
    summary = timing.summarize(times, BASELINE, per_block)
    applied = {v: b.all_steps_applied() for v, b in built.items()}
  finally:
    for b in built.values():
      b.session.close()
  num_variables = built[BASELINE].variables
  base_nodes, _, base_types = counts[BASELINE]
  for variant, s in summary.items():
    nodes, stable, types = counts[variant]
    by_type = types.copy()
    by_type.subtract(base_types)
    s.update({
        "label": variants_lib.LABELS[variant],
        "executed_nodes": nodes,
        "executed_nodes_stable": stable,
        "extra_executed_nodes": nodes - base_nodes,
        "extra_executed_nodes_per_variable": (nodes - base_nodes) /
                                             num_variables,
        # Where the extra nodes come from (negative: fewer than plain).
        "extra_executed_by_op_type": dict(sorted(
            ((t, n) for t, n in by_type.items() if n), key=lambda x: -x[1])),
        "all_steps_applied": applied[variant],
    })
  log_fn("%s: done in %.0fs" % (name, time.time() - start))
  return {"workload": workload, "num_towers": num_towers,
          "variables": num_variables, "steps_per_block": per_block,
          "build_seconds": round(build_seconds, 1), "variants": summary}


def run(config, log_fn=print):
  """Measures every cell of `config`; returns the JSON-able results.

  Args:
    config: a `GrowthConfig` (validated here).
    log_fn: callable(str) for progress lines.

  Returns:
    A dict: `benchmark`, `config`, `machine`, `baseline`, `cells` (cell
    name `<workload>/towers_<n>` -> `measure_cell` dict), `skipped_cells`
    and `seconds`.
  """
  config.validate()
  start = time.time()
  machine = guard_overhead_lib.machine_info()
  cells = config.cells()
  cell_budget = config.max_timing_seconds / len(cells)
  results = collections.OrderedDict()
  for workload, num_towers in cells:
    results[_cell_name(workload, num_towers)] = measure_cell(
        config, workload, num_towers, cell_budget, log_fn)
  machine["load_average_end"] = timing.load_average()
  return {
      "benchmark": "cost_growth",
      "config": dataclasses.asdict(config),
      "machine": machine,
      "baseline": BASELINE,
      "cells": results,
      "skipped_cells": [_cell_name(*c) for c in config.skipped_cells()],
      "seconds": round(time.time() - start, 1),
  }


def _cell_text(s):
  cpu = s["cpu_ratio_to_baseline"]
  return "%.2f / %s / %+d (%+.1f)" % (
      s["ratio_to_baseline"], "-" if cpu is None else "%.2f" % cpu,
      s["extra_executed_nodes"], s["extra_executed_nodes_per_variable"])


def markdown(results):
  """The results as one Markdown row per cell, and a legend."""
  shown = [v for v in variants_lib.VARIANTS if v != BASELINE]
  header = (["workload", "variables", "towers", "plain: nodes/step",
             "A/A control ×"] + [variants_lib.LABELS[v] for v in shown])
  rows = []
  for cell in results["cells"].values():
    by_variant = cell["variants"]
    control = by_variant.get(variants_lib.CONTROL)
    rows.append(
        [cell["workload"], str(cell["variables"]), str(cell["num_towers"]),
         str(by_variant[BASELINE]["executed_nodes"]),
         "-" if control is None else "%.2f" % control["ratio_to_baseline"]] +
        [_cell_text(by_variant[v]) for v in shown])
  config, machine = results["config"], results["machine"]
  blocks = [c["variants"][BASELINE]["blocks"]
            for c in results["cells"].values()]
  legend = [
      "Each variant cell: time × plain / CPU-time × plain / executed nodes "
      "per step more than plain (per variable). × plain is the median over "
      "rounds of the variant's steps/s divided by plain's in the same round "
      "(1.00 = free); the CPU-time ratio uses the process's CPU seconds per "
      "step (work, less disturbed by other processes).",
      "Executed nodes: counted from the step stats of a traced step "
      "(`bench/executed_ops.py`); deterministic, so they decide where the "
      "ratios are within the A/A control's noise.",
      "Batch 32 per tower, one fixed batch, momentum SGD; towers on virtual "
      "CPU devices sharing %d CPUs; %d warm-up steps, then %d–%d rounds per "
      "cell in one process, variants in a new order each round; load "
      "average %s before, %s after; TF %s; %.0f s in all." % (
          machine["cpu_count"], config["warmup_steps"], min(blocks),
          max(blocks), machine["load_average_start"],
          machine["load_average_end"], machine["tensorflow"],
          results["seconds"]),
  ]
  if min(blocks) < 10:
    legend.insert(0, "**%d rounds are too few for the ratios to mean "
                  "anything** (--quick checks that everything runs; the "
                  "node counts are exact)." % min(blocks))
  if results["skipped_cells"]:
    legend.append("Not measured (more than %d variables × towers, for build "
                  "time): %s." % (config["max_tower_variables"],
                                  ", ".join(results["skipped_cells"])))
  unstable = ["%s %s" % (name, v) for name, c in results["cells"].items()
              for v, s in c["variants"].items()
              if not s["executed_nodes_stable"]]
  if unstable:
    legend.append("**Executed nodes differed between two traced steps**: "
                  "%s." % ", ".join(unstable))
  return (timing.markdown_table(header, rows) + "\n\n" +
          "\n".join("- " + line for line in legend))
