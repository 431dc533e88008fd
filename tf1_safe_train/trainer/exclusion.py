"""Never feed it again: the examples of reproducible skips, by id.

At startup the trainer reads every worker's `skips.jsonl` of its train_dir;
a record whose replay found evidence of data (`exclude`: see `replay_lib`)
names its examples: the rows of the input that held NaN/Inf (`replay.input_ids`)
or, when the input was finite (the batch drove the model non-finite), the
offending tower's whole batch. It also reads the data windows rollbacks
abandoned (`rollback_window`): a restarted process must not feed them again
either. The input pipeline drops them by id.
"""

from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer import rollback_window
from tf1_safe_train.trainer import train_dir as train_dir_lib


def _ids_of(record):
  replay = record.get("replay") or {}
  if replay.get("input_ids"):
    return "nonfinite_input", replay["input_ids"]
  tower = replay.get("tower")
  for entry in record.get("towers", []):
    if entry.get("index") == tower:
      return "reproducible_batch", entry.get("example_ids") or []
  return "reproducible_batch", []


def excluded(train_dir):
  """(sorted example ids to drop, summary dict) from `train_dir`'s logs.

  `train_dir` None: nothing is dropped (exclusion turned off).

  The summary: count (examples), by_reason (examples per reason:
  nonfinite_input, reproducible_batch, rollback_window), steps (the skips
  that named them), rollbacks (the steps of the rollbacks that did).

  Raises:
    train_dir.TrainDirError: if a log holds a line that is not a record.
  """
  ids, by_reason, steps = set(), {}, []
  try:
    records = skip_log.read_all(train_dir) if train_dir else []
    windows = rollback_window.excluded_ids(train_dir) if train_dir else []
  except skip_log.SkipLogError as e:
    raise train_dir_lib.TrainDirError(
        "%s (repair or move the file, or train with "
        "--noexclude_reproducible_skips)" % e)
  for record in records:
    # `exclude`: the replay's evidence said the data (records written
    # before it was recorded: whenever the fault reproduced).
    if not record.get("exclude", record.get("reproduced")):
      continue
    reason, record_ids = _ids_of(record)
    new = set(int(i) for i in record_ids) - ids
    ids |= new
    by_reason[reason] = by_reason.get(reason, 0) + len(new)
    steps.append({"step": record["step"], "worker": record["worker"]})
  rollbacks = []
  for at_step, window_ids in windows:
    new = set(window_ids) - ids
    ids |= new
    by_reason[rollback_window.REASON] = by_reason.get(
        rollback_window.REASON, 0) + len(new)
    rollbacks.append(at_step)
  summary = {"count": len(ids), "by_reason": by_reason, "steps": steps}
  if rollbacks:
    summary["rollbacks"] = rollbacks
  return sorted(ids), summary


def describe(summary):
  """The startup line for `excluded`'s summary, or None if none is dropped.

  A restarted run reads fewer examples than its data holds: say how many
  and why, once, where the run's other startup lines are.
  """
  if not summary["count"]:
    return None
  reasons = ", ".join("%d %s" % (n, reason.replace("_", " "))
                      for reason, n in sorted(summary["by_reason"].items())
                      if n)
  return ("not feeding %d example%s again (%s; "
          "--noexclude_reproducible_skips feeds them)" %
          (summary["count"], "" if summary["count"] == 1 else "s", reasons))
