"""What a skip says, built in one place for the wrapper and the trainer.

A skipped step (or a dry-run criterion's would-be skip) is told three ways:
its log line, its `skips.jsonl` record and its TensorBoard scalars. Each is
built here from what the step fetched and from `reasons.Report` (per
reason its flag, values and counters; the label of a skip), looping over
the criteria: no criterion is named here, so a new one is told everywhere
with no edit, and changing what a skip says is one edit in this module.
`step_report` (the wrapper's hook), `wrapper_replay`, and the trainer's
hooks, forensics, summaries and run summary call it.
"""

import collections
import time

import numpy as np

# (No TensorFlow: the early checks' modules, e.g. the rollback window's
# record, write through it.)
from tf1_safe_train.core import criterion_spec as criteria_lib

NONFINITE = criteria_lib.NONFINITE
# The tag prefix of every skip counter in TensorBoard.
TAG_PREFIX = "skips/"
# run_summary.json's per-reason fields from before "skips_by_reason", kept
# (0 when the reason is not counted) for the scripts that read them.
LEGACY_REASON_FIELDS = (NONFINITE, "spike")


def format_scale(scale):
  """A loss scale as printed: whole numbers in full (1048576, not 1.04858e+06)."""
  scale = float(scale)
  if scale.is_integer() and abs(scale) < 2.0**53:
    return "%d" % scale
  return "%g" % scale


def names(all_names, flags, max_names=5):
  """The names whose flag is set, the first `max_names` and "+N more"."""
  bad = [n for n, f in zip(all_names, flags) if f]
  shown = ", ".join(bad[:max_names])
  if len(bad) > max_names:
    shown += ", ... (+%d more, %d in all)" % (len(bad) - max_names, len(bad))
  return shown


# The line.


def nonfinite_words(tower_flags, average_flags, variable_names,
                    tower_devices, max_names=5):
  """Where a step's NaN/Inf was: "non-finite gradients in tower 1
  (/device:CPU:1); variables: w" (the skip line's words after "step N: ").

  Args:
    tower_flags: bool array [num_towers, num_variables], per-tower flags, or
      [num_towers], one fused flag per tower (the variables are then named
      by `average_flags` alone: a NaN/Inf of any tower survives averaging).
    average_flags: bool array [num_variables], the averaged gradients'.
    variable_names: names aligned with the flags' last axis.
    tower_devices: each tower's device ("" if unknown: not shown).
    max_names: variable names listed before "+N more".
  """
  tower_flags = np.asarray(tower_flags, dtype=bool)
  by_variable = np.asarray(average_flags, dtype=bool)
  if tower_flags.ndim != 1:
    tower_flags = tower_flags.reshape(len(tower_devices), -1)
    by_variable = tower_flags.any(axis=0) | by_variable
  tower_flags = tower_flags.reshape(len(tower_devices), -1)
  bad_towers = [i for i in range(len(tower_devices)) if tower_flags[i].any()]
  if bad_towers:
    where = "in tower%s %s" % (
        "s" if len(bad_towers) > 1 else "",
        ", ".join("%d (%s)" % (i, tower_devices[i]) if tower_devices[i]
                  else "%d" % i for i in bad_towers))
  else:
    where = "in the averaged gradients (every tower was finite: overflow)"
  return "non-finite gradients %s; variables: %s" % (
      where, names(variable_names, by_variable, max_names) or "-")


def loss_scale_words(scale, floor):
  """What a non-finite skip at loss scale `scale` means (fp16)."""
  if float(scale) > floor:
    return ("loss-scale overflow at scale %s (expected: the scale halves)"
            % format_scale(scale))
  return ("at the floor loss scale %s: a real fault (counts toward "
          "--max_consecutive_skips)" % format_scale(scale))


def criterion_line(report, step, reason, criteria_values, dry_run=False):
  """The line of a skip (or a dry run's would-be skip) for a criterion
  other than non-finite: "skipped step 8: spike, gradient norm ...".

  Args:
    report: the step's `reasons.Report`.
    step: the step's index.
    reason: the criterion's reason (`Report.label`, `Report.would_skip`).
    criteria_values: the fetched `Report.fetches`.
    dry_run: the step was applied; the line says it would be skipped.
  """
  words = report.criterion(reason).describe(criteria_values["values"][reason])
  head = ("step %d: %s would be skipped (dry run: applied)" % (step, reason)
          if dry_run else "skipped step %d: %s" % (step, reason))
  return head + (", " + words if words else "")


def line(step, reason=NONFINITE, report=None, criteria_values=None,
         nonfinite=None, suffixes=()):
  """The line of a skipped step.

  Args:
    step: the step's index (global_step at its start).
    reason: its label (`reasons.Report.label`).
    report, criteria_values: the step's `reasons.Report` and its fetched
      `fetches` (for a reason other than non-finite).
    nonfinite: `nonfinite_words` (or the wrapper's words without towers),
      or None if no gradient was non-finite.
    suffixes: more words of a non-finite skip ("; "-joined after it: the
      loss scale, the update ops' writes).

  Returns:
    "skipped step 7: non-finite gradients in tower 1 (/device:GPU:1);
    variables: conv1/weights", "skipped step 8: spike, ...; and non-finite
    gradients in tower 1 ..." (a tower left out for a NaN/Inf in the step
    a finite criterion skipped), or "skipped step 9".
  """
  if reason != NONFINITE:
    text = criterion_line(report, step, reason, criteria_values)
    return text + ("; and " + nonfinite if nonfinite else "")
  text = "skipped step %d" % step + (": " + nonfinite if nonfinite else "")
  return "; ".join([text] + list(suffixes))


def left_out_worker_line(worker, step, nonfinite=None):
  """A sync worker's line when the worker unit left its contribution out
  (the step was not skipped: the chief applies the others'): "worker 1 left
  out of step 7: non-finite gradients in tower 0 (...)"."""
  return ("worker %d left out of step %d" % (worker, step) +
          (": " + nonfinite if nonfinite else "") +
          "; the healthy workers' pushes decide the step")


def workers_line(step, pushed, healthy, too_few, min_healthy):
  """The chief's line of a sync step whose worker unit left workers out,
  or None if every push was healthy.

  Args:
    step: the step's index.
    pushed, healthy: per worker, its pushes to the step and the healthy
      ones (float counts, summed by the accumulators).
    too_few: whether the step was skipped for too few healthy workers.
    min_healthy: the --min_healthy_workers in force.

  Returns:
    "step 12: worker 1 left out; applied 2 of 3 workers", or "step 12: 0 of
    3 workers healthy, fewer than --min_healthy_workers=2: the whole step
    is skipped".
  """
  pushed = np.rint(np.asarray(pushed, np.float64)).astype(int)
  healthy = np.rint(np.asarray(healthy, np.float64)).astype(int)
  total, kept = int(pushed.sum()), int(healthy.sum())
  if kept == total:
    return None
  if too_few:
    return ("step %d: %d of %d workers healthy, fewer than "
            "--min_healthy_workers=%d: the whole step is skipped"
            % (step, kept, total, min_healthy))
  left = ", ".join("worker %d" % w for w in range(len(pushed))
                   if pushed[w] > healthy[w])
  return "step %d: %s left out; applied %d of %d workers" % (
      step, left, kept, total)


def dry_run_lines(report, step, criteria_values):
  """One line per dry-run criterion that would have skipped an applied
  step."""
  return [criterion_line(report, step, c.reason, criteria_values,
                         dry_run=True)
          for c in report.would_skip(criteria_values)]


# The skips.jsonl record.


def record(step, worker, reason, report=None, criteria_values=None,
           **fields):
  """A skips.jsonl record: step, worker, time, reason, and for a reason
  other than non-finite the criterion's values (`{reason: {...}}`), then
  `fields` (towers, verdict, replay, ...)."""
  head = {"step": int(step), "worker": worker, "time": time.time(),
          "reason": reason}
  if reason != NONFINITE and report is not None:
    head.update(criterion_fields(report, reason, criteria_values))
  return dict(head, **fields)


def criterion_fields(report, reason, criteria_values):
  """A record's fields of `reason`'s criterion (its values, thresholds)."""
  return {reason: report.criterion(reason).record(
      criteria_values["values"][reason])}


def towers(devices, tower_bad, variables, extra=None, indices=None,
           outliers=None):
  """A record's "towers": index, device, nonfinite, variables (the flagged
  towers': `variables`), with `outliers` (the indices of the towers a
  finite criterion named, e.g. "tower_outlier"'s) "outlier" too, and
  `extra(index)`'s fields, for each tower of `indices` (default: all)."""
  if indices is None:
    indices = range(len(tower_bad))
  return [dict({"index": i, "device": devices[i],
                "nonfinite": bool(tower_bad[i]),
                "variables": list(variables) if tower_bad[i] else []},
               **({"outlier": i in outliers} if outliers is not None
                  else {}),
               **(extra(i) if extra else {}))
          for i in indices]


# TensorBoard and run_summary.json.

# Per-tower counts a run may keep beside `nonfinite_steps_by_tower` (the
# tower unit's steps applied without each tower; --skip_tower_outliers'
# steps each tower was named an outlier), by their checkpoint names, which
# run_summary.json's fields and TensorBoard's "skips/<name>_tower_<i>"
# (name without "_by_tower") follow.
TOWER_COUNTS = ("rejected_by_tower", "tower_outlier_by_tower")


def tower_count_fields(values):
  """run_summary.json's per-tower count fields of fetched (or restored)
  `values` (a dict by name; the counts a run does not keep are absent)."""
  return {name: [int(c) for c in values[name]] for name in TOWER_COUNTS
          if name in values}


def tower_count_tags(values):
  """{"<name>": counts} of `values`' per-tower counts, for `counter_tags`'s
  `by_tower` ("rejected", "tower_outlier")."""
  return {name[:-len("_by_tower")]: values[name] for name in TOWER_COUNTS
          if name in values}



def counter_tags(counters, counts, by_tower, by_worker=None):
  """{tag: value} of a step's counters as TensorBoard shows them.

  Args:
    counters: a `counters.SkipCounters` (of values or tensors).
    counts: `reasons.Report.counts` (one counter per reason).
    by_tower: dict name -> per-tower values, e.g. {"nonfinite_steps":
      [...], "rejected": [...]}: tags "skips/<name>_tower_<i>".
    by_worker: the same per worker (--skip_unit=worker: {"rejected":
      [...]}): tags "skips/<name>_worker_<i>".
  """
  tags = collections.OrderedDict(
      (TAG_PREFIX + name, value)
      for name, value in counters._asdict().items())
  tags.update(reason_tags(counts))
  for unit, by_unit in (("tower", by_tower), ("worker", by_worker or {})):
    for name, values in by_unit.items():
      for i, value in enumerate(values):
        tags["%s%s_%s_%d" % (TAG_PREFIX, name, unit, i)] = value
  return tags


def reason_tags(counts):
  """{"skips/<counter>": value} of `reasons.Report.counts`
  (skips/nonfinite_skips, skips/spike_skips, a dry run's
  skips/spike_would_skips, ...)."""
  return collections.OrderedDict(
      (TAG_PREFIX + name, value) for name, value in sorted(counts.items()))


def summary_counts(counts):
  """run_summary.json's fields from fetched `Report.counts`:
  "skips_by_reason" and, with a dry run, "would_skips_by_reason"."""
  by_reason = collections.OrderedDict()
  would = collections.OrderedDict()
  for name, value in sorted(counts.items()):
    reason, dry_run = criteria_lib.counter_reason(name)
    (would if dry_run else by_reason)[reason] = int(value)
  return dict({"skips_by_reason": dict(by_reason)},
              **({"would_skips_by_reason": dict(would)} if would else {}))


def summary_fields(counts):
  """`summary_counts`, and the legacy per-reason fields ("nonfinite_skips",
  "spike_skips": `LEGACY_REASON_FIELDS`)."""
  fields = summary_counts(counts)
  for reason in LEGACY_REASON_FIELDS:
    fields[criteria_lib.counter_name(reason)] = fields[
        "skips_by_reason"].get(reason, 0)
  return fields


def progress_words(counts):
  """The progress line's words for fetched `Report.counts` (reasons other
  than non-finite), e.g. " (1 spike)" or " (2 spikes; 1 would-be spike)"."""
  by_reason = summary_counts(counts)
  words = ["%d %s%s" % (n, r, "" if n == 1 else "s")
           for r, n in sorted(by_reason["skips_by_reason"].items())
           if r != NONFINITE]
  would = ["%d would-be %s%s" % (n, r, "" if n == 1 else "s")
           for r, n in sorted(by_reason.get("would_skips_by_reason",
                                            {}).items())]
  words = "; ".join(w for w in (", ".join(words), ", ".join(would)) if w)
  return " (%s)" % words if words else ""
