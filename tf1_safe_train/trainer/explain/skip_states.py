"""The saved states of explained skips, `<train_dir>/skips/`: named, bounded.

Each explained skip saves the state it saw in a directory of its own,
`skips/step-N-K/` (worker w of a cluster: `skips/workerw-step-N-K/`): K
counts that worker's saved states in the train_dir, so a step that skips
again (re-run after a restart, or recurring with
`--noincrement_global_step_on_skip`) never overwrites another event's
state, and a name is never reused, even after pruning. Directories written
before K existed (`skips/step-N/`) count as K = 0. `prune` keeps a worker's
newest states (highest K) and deletes the older ones; their records stay in
`skips.jsonl`. A state's batches are `batch.npz` (`save_batches`); `save`
writes a whole state (checkpoint, batches, params.json), `save_into` a
skip's, its directory (or why none: a full disk) in the skip's record.
"""

import json
import os
import re
import shutil

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.run import disk_full

SKIPS_DIR = "skips"
BATCH_FILE = "batch.npz"
PARAMS_FILE = "params.json"
CHECKPOINT_PREFIX = "state"
_NAME = re.compile(r"^(?:worker(\d+)-)?step-(\d+)(?:-(\d+))?$")


def _prefix(worker):
  return "step-" if worker == 0 else "worker%d-step-" % worker


def _states(train_dir, worker):
  """[(K, step, name)] of `worker`'s state directories, oldest first."""
  root = os.path.join(train_dir, SKIPS_DIR)
  try:
    names = os.listdir(root)
  except (FileNotFoundError, NotADirectoryError):
    return []
  found = []
  for name in names:
    match = _NAME.match(name)
    if (match and int(match.group(1) or 0) == worker and
        os.path.isdir(os.path.join(root, name))):
      found.append((int(match.group(3) or 0), int(match.group(2)), name))
  return sorted(found)


def _recorded(train_dir, worker):
  """The state_dirs the worker's records name (a damaged log names none:
  the restart reports it)."""
  try:
    return [r.get("state_dir") for r in skip_log.read(
        skip_log.path(train_dir, worker))]
  except skip_log.SkipLogError:
    return []


def new_dir(train_dir, step, worker=0):
  """Creates and returns the directory of a new explained skip's state.

  K is past every state present and every state a record names, so a name
  whose directory was pruned or deleted by hand is not reused either.
  """
  serials = [k for k, _, _ in _states(train_dir, worker)]
  for state_dir in _recorded(train_dir, worker):
    match = _NAME.match(os.path.basename(str(state_dir or "")))
    if match and int(match.group(1) or 0) == worker:
      serials.append(int(match.group(3) or 0))
  serial = max(serials, default=0) + 1
  while True:  # (Only a directory made by hand can be in the way.)
    directory = os.path.join(train_dir, SKIPS_DIR, "%s%d-%d" % (
        _prefix(worker), step, serial))
    try:
      os.makedirs(directory)
      return directory
    except FileExistsError:
      serial += 1


def prune(train_dir, keep, worker=0):
  """Deletes `worker`'s oldest states beyond the newest `keep`; returns the
  names deleted."""
  states = _states(train_dir, worker)
  doomed = [name for _, _, name in states[:max(len(states) - keep, 0)]]
  for name in doomed:
    shutil.rmtree(os.path.join(train_dir, SKIPS_DIR, name),
                  ignore_errors=True)
  return doomed


def save_batches(directory, batches):
  """Writes every tower's (images, labels, ids) to `batch.npz`."""
  arrays = {}
  for tower, (images, labels, ids) in enumerate(batches):
    arrays.update({"images_%d" % tower: images, "labels_%d" % tower: labels,
                   "ids_%d" % tower: ids})
  np.savez(os.path.join(directory, BATCH_FILE), **arrays)


def load_batches(directory):
  """The towers' (images, labels, ids) saved by `save_batches`."""
  with np.load(os.path.join(directory, BATCH_FILE)) as arrays:
    towers = sum(1 for k in arrays.files if k.startswith("images_"))
    return [tuple(arrays["%s_%d" % (k, t)] for k in ("images", "labels",
                                                      "ids"))
            for t in range(towers)]


def save(train_dir, worker, step, batches, params, scale, saver, session,
         keep):
  """Saves the state an explained skip saw (exact: a skip moves nothing) in
  a `new_dir`, then `prune`s to the newest `keep`; returns the directory.

  Args:
    train_dir, worker, step: whose state (`new_dir`).
    batches: every tower's (images, labels, ids).
    params: the run's params as a dict (`params.TrainParams.to_dict`).
    scale: the loss scale the step used, or None.
    saver, session: a `tf1.train.Saver` of the model's state and the
      session to save it from.
    keep: the worker's states kept (--max_explained_skips).
  """
  directory = new_dir(train_dir, step, worker)
  save_batches(directory, batches)
  with open(os.path.join(directory, PARAMS_FILE), "w") as f:
    json.dump({"params": params, "step": step, "worker": worker,
               "loss_scale": scale}, f, indent=2, sort_keys=True)
  saver.save(session, os.path.join(directory, CHECKPOINT_PREFIX),
             write_meta_graph=False, write_state=False)
  prune(train_dir, keep, worker)
  return directory


def save_into(record, params, worker, batches, saver, session, keep):
  """`save`s the state of the skip of `record` (its "step", "loss_scale");
  its directory in the record's "state_dir", relative to the train_dir.

  A full disk is no reason to end the run: the record matters more than
  the state (its ids are excluded on a restart), so it gets "state_dir"
  None and "state_error" instead, and the run goes on.

  Args:
    record: the skip's skips.jsonl record, updated in place.
    params: the run's `params.TrainParams`.
    worker, batches, saver, session, keep: as `save`'s.
  """
  try:
    record["state_dir"] = os.path.relpath(save(
        params.train_dir, worker, record["step"], batches, params.to_dict(),
        record.get("loss_scale"), saver, session, keep), params.train_dir)
  except (OSError, tf.errors.OpError) as e:
    if disk_full.path_of(e) is None:
      raise
    record["state_dir"] = None
    record["state_error"] = disk_full.describe(e)
    logging.warning("step %d: the skip's state for //:replay not saved: "
                    "%s; its record is kept", record["step"],
                    record["state_error"])
