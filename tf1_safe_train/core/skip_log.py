"""`skips.jsonl`: one JSON object per skip event, appended durably.

The trainer and the wrapper's hook write the same records (see `RECORD_KEYS`
for the keys every record has); `//:replay` and a restart read them back.
A record is one line written with a single `write` on a file opened for
appending and fsynced before `append` returns, so a SIGKILL leaves at most a
torn last line. A last line without its newline is judged once, the same way
by `read` and by the next `append`: if it parses it is complete (read, and
the next append restores its newline); if not it is torn (its writer never
returned): `read` drops it with a warning and the next append cuts it off.
Every record is kept: a step re-run after a restart from an older checkpoint,
or a step that recurs (`--noincrement_global_step_on_skip`), skips on other
data, so each skip event is a record of its own, never merged by step.
Records are validated when read (`SkipLogError` names the file, the line and
the problem): they decide what a restart excludes.
"""

import json
import math
import numbers
import os

from absl import logging

FILENAME = "skips.jsonl"

# The keys of every record (more may follow, e.g. "replay", "verdict").
#   step: global_step at the start of the skipped step (int).
#   worker: task index of the worker that ran it (0 alone).
#   time: seconds since the epoch when it was recorded (float).
#   reason: the label of the skip criterion that fired first ("nonfinite",
#     "spike", a criterion's own `reason`); a record with "dry_run": true
#     is a dry-run criterion's would-be skip of a step that was applied.
#   towers: list of per-tower dicts (index, device, nonfinite, loss,
#     example_ids, batch_hash, variables), as much as the writer knows.
RECORD_KEYS = ("step", "worker", "time", "reason", "towers")
_INT64 = (-2**63, 2**63)


class SkipLogError(ValueError):
  """A log cannot be read, or a line other than a torn last one is not a
  valid record; the message names the file (and line) and the problem."""


def path(directory, worker=0):
  """The log of `worker` in `directory` (one file per worker of a cluster)."""
  if worker == 0:
    return os.path.join(directory, FILENAME)
  return os.path.join(directory, "skips-worker%d.jsonl" % worker)


def file_problem(file_path):
  """Why `file_path` cannot be read back as a file, or None (absent or a
  regular file): a directory, a dangling symlink, a device, a FIFO."""
  if os.path.islink(file_path) and not os.path.exists(file_path):
    return "is a dangling symlink (to %s)" % os.readlink(file_path)
  if not os.path.exists(file_path) or os.path.isfile(file_path):
    return None
  return ("is a directory" if os.path.isdir(file_path)
          else "is not a regular file")


def _clean(value):
  """`value` with non-finite floats as None (strict JSON has no NaN)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {str(k): _clean(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_clean(v) for v in value]
  if hasattr(value, "tolist") and callable(value.tolist):  # NumPy values.
    return _clean(value.tolist())
  return value


def encode(record):
  """`record` as its one line of JSON (without the newline): strict JSON,
  non-finite floats as null, keys sorted (equal records, equal lines)."""
  return json.dumps(_clean(record), sort_keys=True, allow_nan=False)


def append(log_path, record):
  """Appends `record` (a dict with `RECORD_KEYS`) and fsyncs it.

  Raises:
    ValueError: if a key of `RECORD_KEYS` is missing.
    SkipLogError: if the log is not a regular file.
  """
  missing = [k for k in RECORD_KEYS if k not in record]
  if missing:
    raise ValueError("skip record lacks %s" % ", ".join(missing))
  line = encode(record) + "\n"
  problem = file_problem(log_path)
  if problem:
    raise SkipLogError("%s %s" % (log_path, problem))
  _mend_last_line(log_path)
  fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    data = line.encode("utf-8")
    # One write of the whole line: appends of one line never interleave.
    written = os.write(fd, data)
    if written != len(data):
      raise OSError("short write to %s" % log_path)
    os.fsync(fd)
  finally:
    os.close(fd)


def _parses(raw):
  try:
    json.loads(raw.decode("utf-8"))
    return True
  except ValueError:
    return False


def _mend_last_line(log_path):
  """A last line without its newline: restored if it parses (the record is
  complete; `read` honours it), else cut off with a warning (torn)."""
  if not os.path.exists(log_path):
    return
  with open(log_path, "r+b") as f:
    data = f.read()
    if not data or data.endswith(b"\n"):
      return
    start = data.rfind(b"\n") + 1
    if _parses(data[start:]):
      f.write(b"\n")
    else:
      logging.warning("%s: dropped a torn last line (%d bytes, a write cut "
                      "short)", log_path, len(data) - start)
      f.truncate(start)
    f.flush()
    os.fsync(f.fileno())


def id_problem(value):
  """Why `value` is not an example id (an int64 JSON integer), or None."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    return "%s is not an integer" % json.dumps(value)
  if not _INT64[0] <= value < _INT64[1]:
    return "%d does not fit int64" % value
  return None


def ids_problem(name, values):
  """Why `values` is not a list of example ids, or None."""
  if not isinstance(values, list):
    return "%s is %s, not a list of ids" % (name, json.dumps(values)[:40])
  for value in values:
    problem = id_problem(value)
    if problem:
      return "%s: %s" % (name, problem)
  return None


def _count_problem(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    return "%s is %s, not an int >= 0" % (name, json.dumps(value)[:40])
  return None


def record_problem(record):
  """Why `record` is not a skip record, or None (the fields read back)."""
  if not isinstance(record, dict):
    return "not a JSON object"
  missing = [k for k in RECORD_KEYS if k not in record]
  if missing:
    return "not a skip record (no %s)" % ", ".join(missing)
  problem = (_count_problem("step", record["step"]) or
             _count_problem("worker", record["worker"]))
  if problem:
    return problem
  towers = record["towers"]
  if not isinstance(towers, list) or not all(isinstance(t, dict)
                                             for t in towers):
    return "towers is not a list of objects"
  for tower in towers:
    problem = (("index" in tower and _count_problem("tower index",
                                                    tower["index"])) or
               ids_problem("example_ids", tower.get("example_ids") or []))
    if problem:
      return problem
  replay = record.get("replay")
  if replay is not None:
    if not isinstance(replay, dict):
      return "replay is %s, not an object" % json.dumps(replay)[:40]
    problem = (("tower" in replay and _count_problem("replay tower",
                                                     replay["tower"])) or
               ids_problem("replay input_ids", replay.get("input_ids") or []))
    if problem:
      return problem
  for flag in ("reproduced", "exclude"):
    if not isinstance(record.get(flag, False), bool):
      return "%s is not true or false" % flag
  if not isinstance(record.get("state_dir") or "", str):
    return "state_dir is not a string"
  return None


def read_lines(log_path, problem_fn):
  """The valid records of a JSON-lines log, in file order.

  Args:
    log_path: the file; missing: no records.
    problem_fn: record -> why it is invalid, or None.

  Raises:
    SkipLogError: the file cannot be read, or a line other than a torn last
      one is not valid JSON or not a valid record.
  """
  problem = file_problem(log_path)
  if problem:
    raise SkipLogError("%s %s" % (log_path, problem))
  try:
    with open(log_path, "rb") as f:
      lines = f.read().split(b"\n")
  except FileNotFoundError:
    return []
  except OSError as e:
    raise SkipLogError("%s cannot be read: %s" % (log_path, e.strerror or e))
  records = []
  for number, raw in enumerate(lines, 1):
    if not raw.strip():
      continue
    try:
      record = json.loads(raw.decode("utf-8"))
    except ValueError as e:
      if number == len(lines):  # No newline, and incomplete: torn.
        logging.warning("%s line %d: ignored a torn last line (a write cut "
                        "short)", log_path, number)
        continue
      raise SkipLogError("%s line %d: not JSON (%s)" % (log_path, number, e))
    problem = problem_fn(record)
    if problem:
      raise SkipLogError("%s line %d: %s" % (log_path, number, problem))
    records.append(record)
  return records


def read(log_path):
  """Every record of a log, one per skip event, in step order (the records
  of one step in the order written).

  A missing file has none; a torn last line (a write cut by SIGKILL) is
  ignored with a warning.

  Raises:
    SkipLogError: naming the file and line, for any other line that is not
      a valid record, or the file that cannot be read.
  """
  return sorted(read_lines(log_path, record_problem),
                key=lambda r: r["step"])


def read_all(directory):
  """The records of every worker's log in `directory`, in step order (the
  records of one step in the order written)."""
  records = []
  names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
  for name in names:
    if name == FILENAME or (name.startswith("skips-worker") and
                            name.endswith(".jsonl")):
      records.extend(read(os.path.join(directory, name)))
  return sorted(records, key=lambda r: (r["step"], r["worker"]))
