"""Side-by-side timing: variants interleaved round-robin in one process.

Every round runs one block of steps of every variant, in a new random order,
so machine drift, other processes' load, the position in the round and the
variant run just before (whose data fill the caches) hit all variants alike;
a variant's ratio to the baseline is the median over rounds of the ratio
measured within each round, with a bootstrap interval. `markdown_table`
prints such results.
"""

import collections
import json
import os
import statistics
import sys
import time

import numpy as np

BlockTimes = collections.namedtuple("BlockTimes", ["wall", "cpu"])
BlockTimes.__doc__ = """Seconds per timed block of one variant, one per round.

Attributes:
  wall: wall-clock seconds of each block.
  cpu: CPU seconds the whole process used during each block (all threads).
"""


def round_robin(step_fns, rounds, steps_per_block, warmup_steps,
                progress_fn=None, seed=0, max_seconds=None, min_rounds=3):
  """Times `step_fns` interleaved, after warming each up.

  Args:
    step_fns: ordered dict of name -> callable running one training step.
    rounds: number of rounds; each times one block of every variant.
    steps_per_block: steps per timed block.
    warmup_steps: untimed steps of each variant first (graph optimisation,
      allocator and thread-pool warm-up).
    progress_fn: optional callable(round_index) called after each round.
    seed: seed of the rounds' orders. A round never starts with the variant
      that ended the previous one: a block right after its own variant's
      finds warm caches, which the others do not.
    max_seconds: if set, no new round starts once the timed rounds have
      taken this long (wall clock), unless fewer than `min_rounds` ran.
    min_rounds: see `max_seconds`.

  Returns:
    A dict of name -> `BlockTimes`.

  Raises:
    ValueError: if a count is out of range or there is no variant.
  """
  if not step_fns:
    raise ValueError("round_robin: no variant to time")
  for what, value, low in (("rounds", rounds, 1),
                           ("steps_per_block", steps_per_block, 1),
                           ("warmup_steps", warmup_steps, 0)):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError("round_robin: %s must be an int >= %d, got %r" %
                       (what, low, value))
  names = list(step_fns)
  for name in names:
    for _ in range(warmup_steps):
      step_fns[name]()
  wall = {name: [] for name in names}
  cpu = {name: [] for name in names}
  rng = np.random.default_rng(seed)
  last = None
  start = time.monotonic()
  for r in range(rounds):
    if (max_seconds is not None and r >= min_rounds and
        time.monotonic() - start > max_seconds):
      break
    order = [names[i] for i in rng.permutation(len(names))]
    if len(order) > 1 and order[0] == last:
      swap = int(rng.integers(1, len(order)))
      order[0], order[swap] = order[swap], order[0]
    last = order[-1]
    for name in order:
      step = step_fns[name]
      wall_start, cpu_start = time.perf_counter(), time.process_time()
      for _ in range(steps_per_block):
        step()
      wall[name].append(time.perf_counter() - wall_start)
      cpu[name].append(time.process_time() - cpu_start)
    if progress_fn is not None:
      progress_fn(r)
  return {name: BlockTimes(wall[name], cpu[name]) for name in names}


def _median_interval(values, confidence=0.95, resamples=2000, seed=0):
  """Bootstrap interval of the median of `values` (fixed seed: reproducible)."""
  values = np.asarray(values, dtype=np.float64)
  if values.size < 2:
    return float(values[0]), float(values[0])
  rng = np.random.default_rng(seed)
  picks = rng.integers(0, values.size, size=(resamples, values.size))
  medians = np.median(values[picks], axis=1)
  tail = (1.0 - confidence) / 2.0 * 100.0
  low, high = np.percentile(medians, [tail, 100.0 - tail])
  return float(low), float(high)


def summarize(times, baseline, steps_per_block):
  """Throughput of each variant and its ratio to `baseline`.

  Args:
    times: dict name -> `BlockTimes`, as `round_robin` returns (every variant
      has one block per round).
    baseline: the name of the baseline variant.
    steps_per_block: steps per block.

  Returns:
    A dict name -> dict with `steps_per_sec_median`, `steps_per_sec_min`,
    `steps_per_sec_max` (over blocks), `ratio_to_baseline` (median over
    rounds of this variant's steps/s divided by the baseline's in the same
    round), `ratio_ci95` (bootstrap interval of that median),
    `ratio_of_medians`, `cpu_ratio_to_baseline` (the same paired median, on
    steps per CPU-second of the process), `blocks`, `steps_timed`, and the
    raw `block_wall_seconds` and `block_cpu_seconds`.

  Raises:
    ValueError: if `baseline` is not in `times`.
  """
  if baseline not in times:
    raise ValueError("summarize: baseline %r is not among %s" %
                     (baseline, sorted(times)))
  base = times[baseline]
  base_rate = statistics.median(steps_per_block / w for w in base.wall)
  summary = {}
  for name, t in times.items():
    rates = [steps_per_block / w for w in t.wall]
    # Same steps per block, so the throughput ratio is a ratio of times.
    paired = [b / w for w, b in zip(t.wall, base.wall)]
    cpu_paired = [b / c for c, b in zip(t.cpu, base.cpu) if c > 0]
    low, high = _median_interval(paired)
    summary[name] = {
        "steps_per_sec_median": statistics.median(rates),
        "steps_per_sec_min": min(rates),
        "steps_per_sec_max": max(rates),
        "ratio_to_baseline": statistics.median(paired),
        "ratio_ci95": [low, high],
        "ratio_of_medians": statistics.median(rates) / base_rate,
        "cpu_ratio_to_baseline": (statistics.median(cpu_paired)
                                  if cpu_paired else None),
        "blocks": len(rates),
        "steps_timed": len(rates) * steps_per_block,
        # The raw blocks, round by round, for whoever wants other statistics.
        "block_wall_seconds": [round(w, 5) for w in t.wall],
        "block_cpu_seconds": [round(c, 5) for c in t.cpu],
    }
  return summary


def load_average():
  """The 1, 5 and 15 minute load averages, or None where unavailable."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def write_text(path, text):
  """Writes `text` to `path`, creating its directory."""
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


def publish(results, table, json_out, markdown_out, log_fn):
  """Prints a benchmark's table; writes it and its JSON results if asked.

  Args:
    results: the JSON-able results.
    table: their Markdown table.
    json_out: path for the JSON, or "" for none.
    markdown_out: path for the table, or "" for none.
    log_fn: `log_fn(format, *args)` names each file written.
  """
  sys.stdout.write(table + "\n")
  sys.stdout.flush()
  if json_out:
    write_text(json_out, json.dumps(results, indent=2) + "\n")
    log_fn("results: %s", json_out)
  if markdown_out:
    write_text(markdown_out, table + "\n")
    log_fn("table: %s", markdown_out)


def markdown_table(header, rows):
  """Formats a Markdown table.

  Args:
    header: list of column titles.
    rows: list of lists of cell strings, each as long as `header`.

  Returns:
    The table as a string (no trailing newline).
  """
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  for row in rows:
    if len(row) != len(header):
      raise ValueError("markdown_table: row %r has %d cells, header %d" %
                       (row, len(row), len(header)))
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)
