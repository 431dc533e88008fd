"""run_summary.json: what a training run did, written at its end.

See docs/checkpoints.md for the fields. The file is strict JSON: a
non-finite number (a NaN final loss) is written as null and named, with its
value, in "nonfinite_values".
"""

import json
import math
import os

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import skip_report
from tf1_safe_train.trainer.checkpoint import checkpoints

tf1 = tf.compat.v1

RUN_SUMMARY = "run_summary.json"


def write(train_dir, summary):
  """Writes `summary` to `<train_dir>/run_summary.json` atomically.

  Returns:
    The file's path.
  """
  path = os.path.join(train_dir, RUN_SUMMARY)
  summary = to_json(summary)
  with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True, allow_nan=False)
    f.write("\n")
  os.replace(path + ".tmp", path)
  return path


def to_json(summary):
  """`summary` with non-finite floats as None, noted in "nonfinite_values".

  Python's json would write NaN/Infinity, which JSON parsers reject.
  """
  notes = {}

  def clean(value, key):
    if isinstance(value, float) and not math.isfinite(value):
      notes[key] = repr(value)  # 'nan', 'inf' or '-inf'.
      return None
    if isinstance(value, dict):
      return {k: clean(v, "%s.%s" % (key, k) if key else k)
              for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [clean(v, "%s[%d]" % (key, i)) for i, v in enumerate(value)]
    return value

  result = clean(summary, "")
  if notes:
    result["nonfinite_values"] = dict(result.get("nonfinite_values") or {},
                                      **notes)
  return result


def build(params, latest, steps_run, first_step_time, start, end,
          examples_per_step, exit_reason, final=None):
  """The run summary dict of a run.

  Args:
    params: the run's `params.TrainParams`.
    latest: the values fetched after the last step (`hooks.RunStatsHook`'s
      `latest`: global_step, loss, counters, nonfinite_steps_by_tower,
      max_consecutive_skips_seen, optionally loss_scale and skip_reasons),
      or None if no step ran.
    steps_run: steps this run executed.
    first_step_time: time.time() after the first step, or None.
    start: time.time() when the run started.
    end: time.time() when it ended.
    examples_per_step: examples of one step, all towers.
    exit_reason: "max_steps", "too_many_consecutive_skips" or "interrupted".
    final: optional values that override `latest`'s (a cluster's last
      counters).

  Returns:
    A JSON-able dict.
  """
  if latest is None:  # Nothing ran: the checkpoint was already at max_steps.
    return _restored(params, exit_reason, end - start)
  latest = dict(latest, **(final or {}))
  timed_steps = steps_run - 1
  timed_seconds = end - first_step_time if first_step_time else 0.0
  counters = latest["counters"]
  # One counter per reason (`reasons.Report.counts`), each its own count.
  by_reason = skip_report.summary_fields(latest.get("skip_reasons") or {})
  return {
      # (With the fields from before skips_by_reason: nonfinite_skips, ...)
      **by_reason,
      **({"loss_scale": float(latest["loss_scale"])}
         if "loss_scale" in latest else {}),
      "global_step": int(latest["global_step"]),
      "applied_steps": int(counters.applied_steps),
      "skipped_steps": int(counters.skipped_steps),
      "consecutive_skips": int(counters.consecutive_skips),
      "max_consecutive_skips_seen": int(latest["max_consecutive_skips_seen"]),
      "nonfinite_steps_by_tower": [
          int(c) for c in latest["nonfinite_steps_by_tower"]],
      # --skip_unit=tower: steps applied without each tower;
      # --skip_tower_outliers: steps each tower was an outlier.
      **skip_report.tower_count_fields(latest),
      # --skip_unit=worker: steps applied without each worker's push.
      **({"rejected_by_worker": [
          int(c) for c in latest["rejected_by_worker"]]}
         if "rejected_by_worker" in latest else {}),
      "final_loss": float(latest["loss"]),
      "examples_per_sec": (round(timed_steps * examples_per_step /
                                 timed_seconds, 2)
                           if timed_steps > 0 and timed_seconds > 0 else None),
      "steps_this_run": steps_run,
      "wall_seconds": round(end - start, 3),
      "exit_reason": exit_reason,
      "params": params.to_dict(),
  }


def _restored(params, exit_reason, wall_seconds):
  """The run summary of a run that ran no step: the checkpoint's counters."""
  summary = {"exit_reason": exit_reason, "steps_this_run": 0,
             "wall_seconds": round(wall_seconds, 3),
             "params": params.to_dict()}
  checkpoint = checkpoints.latest(params.train_dir)
  if checkpoint is None:
    return dict(summary, global_step=None)
  reader = tf1.train.load_checkpoint(checkpoint)
  names = reader.get_variable_to_shape_map()
  for name in ("global_step", "max_consecutive_skips_seen",
               "rolled_back_steps") + counters_lib.SkipCounters._fields + tuple(
                   n for n in names if n.endswith("_skips")):
    if name in names:
      summary[name] = int(reader.get_tensor(name))
  for name in (("nonfinite_steps_by_tower",) + skip_report.TOWER_COUNTS +
               ("rejected_by_worker",)):
    if name in names:
      summary[name] = [int(c) for c in reader.get_tensor(name)]
  return summary
