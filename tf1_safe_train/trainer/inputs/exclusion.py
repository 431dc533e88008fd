"""Never feed it again: the examples of reproducible skips, by id.

At startup the trainer reads every worker's `skips.jsonl` of its train_dir;
a record whose replay found evidence of data (`exclude`: see `replay_lib`)
names its examples: the rows of the input that held NaN/Inf (`replay.input_ids`)
or, when the input was finite (the batch drove the model non-finite), the
offending tower's whole batch. It also reads the data windows rollbacks
abandoned (`checkpoint_rollback_window`): a restarted process must not feed
them again either. The input pipeline drops them by id.
"""

import numpy as np

from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.inputs import checkpoint_rollback_window
from tf1_safe_train.trainer.run import train_dir as train_dir_lib


def _ids_of(record):
  replay = record.get("replay") or {}
  if replay.get("input_ids"):
    return "nonfinite_input", replay["input_ids"]
  tower = replay.get("tower")
  for entry in record.get("towers", []):
    if entry.get("index") == tower:
      return "reproducible_batch", entry.get("example_ids") or []
  return "reproducible_batch", []


class ExclusionError(train_dir_lib.TrainDirError):
  """The train_dir's exclusions leave too few examples to train on (a
  TrainDirError: the binary's one line and exit code 2)."""


def _records(train_dir):
  """(skip records, rollback windows) of `train_dir`, validated."""
  try:
    return (skip_log.read_all(train_dir),
            checkpoint_rollback_window.excluded_ids(train_dir))
  except skip_log.SkipLogError as e:
    raise train_dir_lib.TrainDirError(
        "%s (repair or move the file, or train with "
        "--noexclude_reproducible_skips)" % e)


def excluded(train_dir, data_ids_fn=None, batch_size=1):
  """(sorted example ids to drop, summary dict) from `train_dir`'s logs.

  The union of the ids of every reproducible record (each skip event is a
  record: several of one step all count) and of every rollback window.

  Args:
    train_dir: the run's directory; None: nothing is dropped (exclusion
      turned off).
    data_ids_fn: () -> sorted ids of the data the run trains on, or None
      (a user pipeline: any id may be one). Ids not in the data are not
      dropped but counted as unknown.
    batch_size: the floor: fewer examples left than this is an error.

  The summary: count (examples), by_reason (examples per reason:
  nonfinite_input, reproducible_batch, rollback_window), steps (the skips
  that named them), rollbacks (the steps of the rollbacks that did), and
  unknown (ids not in the data) with unknown_ids (the first few).

  Raises:
    train_dir.TrainDirError: if a log is not readable or holds a line that
      is not a record; ExclusionError if fewer than `batch_size` examples
      of the data are left.
  """
  records, windows = _records(train_dir) if train_dir else ([], [])
  named = []  # (reason, ids) in the order recorded.
  steps, rollbacks = [], []
  for record in records:
    # `exclude`: the replay's evidence said the data (records written
    # before it was recorded: whenever the fault reproduced).
    if record.get("exclude", record.get("reproduced")):
      named.append(_ids_of(record))
      steps.append({"step": record["step"], "worker": record["worker"]})
  for at_step, window_ids in windows:
    named.append((checkpoint_rollback_window.REASON, window_ids))
    rollbacks.append(at_step)
  data_ids = data_ids_fn() if named and data_ids_fn else None
  ids, unknown, by_reason = set(), set(), {}
  for reason, record_ids in named:
    record_ids = set(record_ids)
    if data_ids is not None:
      outside = record_ids - set(np.intersect1d(
          data_ids, np.array(sorted(record_ids), np.int64)).tolist())
      unknown |= outside
      record_ids -= outside
    new = record_ids - ids
    ids |= new
    by_reason[reason] = by_reason.get(reason, 0) + len(new)
  summary = {"count": len(ids), "by_reason": by_reason, "steps": steps}
  if rollbacks:
    summary["rollbacks"] = rollbacks
  if unknown:
    summary.update(unknown=len(unknown), unknown_ids=sorted(unknown)[:5])
  if data_ids is not None and len(data_ids) - len(ids) < batch_size:
    raise ExclusionError(
        "--train_dir=%s: not feeding the %d examples of its reproducible "
        "skips and rollback windows again leaves %d of the data's %d, fewer "
        "than a batch (--batch_size=%d); train with "
        "--noexclude_reproducible_skips, or on other data" % (
            train_dir, len(ids), len(data_ids) - len(ids), len(data_ids),
            batch_size))
  return sorted(ids), summary


def describe(summary):
  """The startup line for `excluded`'s summary, or None if none is dropped
  and no id is unknown.

  A restarted run reads fewer examples than its data holds: say how many
  and why, once, where the run's other startup lines are.
  """
  unknown = ""
  if summary.get("unknown"):
    unknown = "%d unknown example id%s ignored (not in the data, e.g. %s)" % (
        summary["unknown"], "" if summary["unknown"] == 1 else "s",
        ", ".join(str(i) for i in summary["unknown_ids"]))
  if not summary["count"]:
    return unknown or None
  reasons = ", ".join("%d %s" % (n, reason.replace("_", " "))
                      for reason, n in sorted(summary["by_reason"].items())
                      if n)
  return ("not feeding %d example%s again (%s; "
          "--noexclude_reproducible_skips feeds them)%s" %
          (summary["count"], "" if summary["count"] == 1 else "s", reasons,
           "; " + unknown if unknown else ""))
