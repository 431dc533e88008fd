"""`skips.jsonl`: one JSON object per skipped step, appended durably.

The trainer and the wrapper's hook write the same records (see `RECORD_KEYS`
for the keys every record has); `//:replay` and a restart read them back.
A record is one line written with a single `write` on a file opened for
appending and fsynced before `append` returns, so a SIGKILL leaves at most a
torn last line: `read` ignores it and the next `append` cuts it off (its
writer never returned, so it was never recorded). A step re-run after a restart from an
older checkpoint skips again and appends again: `read` keeps one record per
(worker, step), the last written (the re-run saw the state the restart
restored, which is what a replay now needs).
"""

import json
import math
import os

FILENAME = "skips.jsonl"

# The keys of every record (more may follow, e.g. "replay", "verdict").
#   step: global_step at the start of the skipped step (int).
#   worker: task index of the worker that ran it (0 alone).
#   time: seconds since the epoch when it was recorded (float).
#   reason: "nonfinite" (or another reason the decision knows, e.g. "spike").
#   towers: list of per-tower dicts (index, device, nonfinite, loss,
#     example_ids, batch_hash, variables), as much as the writer knows.
RECORD_KEYS = ("step", "worker", "time", "reason", "towers")


class SkipLogError(ValueError):
  """A skips.jsonl line other than a torn last one is not a record."""


def path(directory, worker=0):
  """The log of `worker` in `directory` (one file per worker of a cluster)."""
  if worker == 0:
    return os.path.join(directory, FILENAME)
  return os.path.join(directory, "skips-worker%d.jsonl" % worker)


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


def append(log_path, record):
  """Appends `record` (a dict with `RECORD_KEYS`) and fsyncs it.

  Raises:
    ValueError: if a key of `RECORD_KEYS` is missing.
  """
  missing = [k for k in RECORD_KEYS if k not in record]
  if missing:
    raise ValueError("skip record lacks %s" % ", ".join(missing))
  line = json.dumps(_clean(record), sort_keys=True, allow_nan=False) + "\n"
  _cut_torn_line(log_path)
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


def _cut_torn_line(log_path):
  """Truncates a last line without its newline, so appends stay lines."""
  if not os.path.exists(log_path):
    return
  with open(log_path, "r+b") as f:
    data = f.read()
    if data and not data.endswith(b"\n"):
      f.truncate(data.rfind(b"\n") + 1)


def read(log_path):
  """The records of a log, one per (worker, step), in step order.

  A missing file has none; a torn last line (a write cut by SIGKILL) is
  ignored.

  Raises:
    SkipLogError: naming the file and line, for any other line that is not
      a JSON record.
  """
  if not os.path.exists(log_path):
    return []
  with open(log_path, "rb") as f:
    lines = f.read().split(b"\n")
  by_key = {}
  for number, raw in enumerate(lines, 1):
    if not raw.strip():
      continue
    torn = number == len(lines)  # The last piece had no newline.
    try:
      record = json.loads(raw.decode("utf-8"))
      if not isinstance(record, dict) or any(k not in record
                                             for k in RECORD_KEYS):
        raise ValueError("not a skip record")
    except ValueError as e:
      if torn:
        continue
      raise SkipLogError("%s line %d: %s" % (log_path, number, e))
    by_key[(record["worker"], record["step"])] = record
  return [by_key[k] for k in sorted(by_key, key=lambda k: (k[1], k[0]))]


def read_all(directory):
  """The records of every worker's log in `directory`, in step order."""
  records = []
  names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
  for name in names:
    if name == FILENAME or (name.startswith("skips-worker") and
                            name.endswith(".jsonl")):
      records.extend(read(os.path.join(directory, name)))
  return sorted(records, key=lambda r: (r["step"], r["worker"]))
