"""A rollback's data window, by example id: kept, recorded, never fed again.

A rollback abandons the batches of global steps [to_step, at_step): those
fed since the restored checkpoint, the streak included. In its process the
input iterator is already past them; the iterator is not in checkpoints,
so a restarted process would feed them again. So:
  * `IdsRing` keeps the example ids of this process's last steps (every
    tower's batch, fetched with the step: a few bytes per example), as many
    steps as the kept checkpoints span, so any window a rollback can choose
    is covered;
  * `append` writes the window's ids to `<train_dir>/rollback_windows.jsonl`
    (`core.skip_log`'s durable append: one fsynced line) before the next
    checkpoint can record the rollback;
  * `excluded_ids` gives them to the startup exclusion (`exclusion`), which
    drops them from a restarted run's input.
Steps of the window run by an earlier process (the run restarted between
the restored checkpoint and the streak) have no ids here: the record counts
them (`steps_without_ids`).
"""

import collections
import json
import os

import numpy as np

from tf1_safe_train.core import skip_log
from tf1_safe_train.core import skip_report

FILENAME = "rollback_windows.jsonl"
REASON = "rollback_window"


def path(train_dir):
  return os.path.join(train_dir, FILENAME)


def ring_steps(keep_checkpoint_max, save_checkpoints_steps,
               max_consecutive_skips):
  """Steps of ids to keep: the span of the kept checkpoints plus a streak
  (the oldest kept checkpoint is at most that many steps back)."""
  return (keep_checkpoint_max * save_checkpoints_steps +
          max_consecutive_skips + 1)


class IdsRing(object):
  """The example ids of the last `capacity` steps, by global step."""

  def __init__(self, capacity):
    self._by_step = collections.OrderedDict()
    self._capacity = capacity

  def add(self, step, tower_ids):
    """Keeps the ids of global step `step` (one array per tower)."""
    # (Without --increment_global_step_on_skip a skip's step recurs.)
    arrays = [self._by_step.pop(step)] if step in self._by_step else []
    self._by_step[step] = np.concatenate(
        arrays + [np.asarray(i, np.int64).reshape([-1]) for i in tower_ids])
    while len(self._by_step) > self._capacity:
      self._by_step.popitem(last=False)

  def window(self, first, last):
    """(sorted unique ids of steps first..last, steps without ids)."""
    arrays, missing = [], 0
    for step in range(first, last + 1):
      if step in self._by_step:
        arrays.append(self._by_step[step])
      else:
        missing += 1
    ids = np.unique(np.concatenate(arrays)) if arrays else np.zeros([0])
    return [int(i) for i in ids], missing


def append(train_dir, at_step, data_window, ids, steps_without_ids):
  """Appends the window's record (durable when it returns)."""
  skip_log.append(path(train_dir), skip_report.record(
      at_step, 0, REASON, towers=[], data_window=list(data_window),
      example_ids=ids, steps_without_ids=steps_without_ids))


def _window_problem(record):
  """Why `record` is not a window record, or None."""
  if not isinstance(record, dict):
    return "not a JSON object"
  step = record.get("step")
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    return "step is %s, not an int >= 0" % json.dumps(step)[:40]
  return skip_log.ids_problem("example_ids", record.get("example_ids"))


def excluded_ids(train_dir):
  """[(at_step, example ids)] of every recorded window of `train_dir`.

  Every record counts: a rollback re-done at the same step after a crash
  abandoned other batches.

  Raises:
    skip_log.SkipLogError: if the file cannot be read, or a line other than
      a torn last one (a write cut by SIGKILL) is not a valid record.
  """
  return [(record["step"], record["example_ids"])
          for record in skip_log.read_lines(path(train_dir),
                                            _window_problem)]
