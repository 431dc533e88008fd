"""Re-running a recorded skip after the run: what `//:replay` does.

An explained skip saved `<train_dir>/skips/step-N-K/` (`forensics`,
`skip_states`): the state the step saw (exact: a skip moves nothing), every
tower's batch and the run's params; each file is checked when read. `replay_recorded` rebuilds the step's graph from those params
on this machine (towers on devices that do not exist fall back to the CPU),
restores that state and replays the recorded tower's batch as the run did
(an outlier's, `outlier_replay`, for its norm against the other batches').
"""

import json
import os

import tensorflow as tf

from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.explain import forensics
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import outlier_replay
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1


class ReplayError(ValueError):
  """The skip cannot be replayed; the message says why in one line."""


def find_record(train_dir, step, worker=0, number=0):
  """A record of `step` in `worker`'s log of `train_dir`.

  A step may have several records (one per skip event: a step re-run after
  a restart, or recurring with --noincrement_global_step_on_skip).

  Args:
    train_dir: the run's directory.
    step: the skipped step.
    worker: the worker whose log to read.
    number: which record of the step, 1 for the first written; 0 for the
      newest.

  Raises:
    ReplayError: no such directory, log, step or record, a damaged log, or
      the skip was not explained (no saved state).
  """
  if not os.path.isdir(train_dir):
    raise ReplayError("--train_dir=%s: no such directory" % train_dir)
  log = skip_log.path(train_dir, worker)
  if not os.path.lexists(log):
    raise ReplayError("%s: no such file (no skip recorded by worker %d)" %
                      (log, worker))
  try:
    records = skip_log.read(log)
  except skip_log.SkipLogError as e:
    raise ReplayError(str(e))
  of_step = [r for r in records if r["step"] == step]
  if not of_step:
    steps = sorted(set(r["step"] for r in records))
    raise ReplayError("%s records no skip of step %d (recorded: %s)" % (
        log, step, ", ".join(str(s) for s in steps[:20]) +
        (", ..." if len(steps) > 20 else "") if steps else "none"))
  if number > len(of_step):
    raise ReplayError("%s records %d skip(s) of step %d, not %d" % (
        log, len(of_step), step, number))
  record = of_step[number - 1] if number else of_step[-1]
  if not record.get("state_dir"):
    raise ReplayError("step %d was recorded but not explained (%s): no "
                      "saved state to replay" % (
                          step, record.get("verdict", "no verdict")))
  return record


def _read_params(directory):
  """(params, loss scale) of a skip's `params.json`."""
  path = os.path.join(directory, forensics.PARAMS_FILE)
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ReplayError("%s: not readable as JSON (%s)" % (
        path, getattr(e, "strerror", None) or e))
  if not isinstance(saved, dict) or not isinstance(saved.get("params"),
                                                   dict):
    raise ReplayError("%s: not a skip's params (no \"params\" object)" %
                      path)
  scale = saved.get("loss_scale")
  if scale is not None and (isinstance(scale, bool) or
                            not isinstance(scale, (int, float))):
    raise ReplayError("%s: loss_scale is not a number" % path)
  try:
    params = params_lib.TrainParams(**saved["params"]).validate()
  except (TypeError, ValueError) as e:
    raise ReplayError("%s: params of another version of the trainer, or "
                      "edited (%s)" % (path, e))
  return params, scale


def _read_batches(directory, params, tower):
  """The towers' batches of a skip's `batch.npz`, checked against its
  params."""
  path = os.path.join(directory, forensics.BATCH_FILE)
  try:
    batches = forensics.load_batches(directory)
  except Exception as e:  # pylint: disable=broad-except
    # np.load of a damaged zip raises zipfile, OS, EOF, Value or Key
    # errors, whichever part it finds damaged first.
    raise ReplayError("%s: damaged (%s: %s)" % (path, type(e).__name__, e))
  if len(batches) != params.num_towers:
    raise ReplayError("%s holds %d tower(s)' batches but %s says "
                      "num_towers=%d (edited?)" % (
                          path, len(batches), forensics.PARAMS_FILE,
                          params.num_towers))
  rows = (params.batch_size,)
  for images, labels, ids in batches:
    if (images.ndim != 4 or images.shape[:1] != rows or
        labels.shape != rows or ids.shape != rows):
      raise ReplayError("%s: a batch of images %s, labels %s, ids %s, not "
                        "%d of each (damaged, or params.json edited?)" % (
                            path, images.shape, labels.shape, ids.shape,
                            params.batch_size))
  if tower >= len(batches):
    raise ReplayError("the record's tower %d is not in %s" % (tower, path))
  return batches


def _load(directory, tower):
  """(params, loss scale, batches) saved in a skip's directory."""
  if not os.path.isdir(directory):
    raise ReplayError("%s: no such directory (pruned: skips/ keeps the "
                      "newest --max_explained_skips states)" % directory)
  for name in (forensics.PARAMS_FILE, forensics.BATCH_FILE,
               forensics.CHECKPOINT_PREFIX + ".index"):
    if not os.path.isfile(os.path.join(directory, name)):
      raise ReplayError("%s: missing %s (the skip's saved state is "
                        "incomplete)" % (directory, name))
  params, scale = _read_params(directory)
  return params, scale, _read_batches(directory, params, tower)


def replay_recorded(train_dir, step, worker=0, number=0):
  """Replays a recorded skip; returns (record, explanation, log line).

  Raises:
    ReplayError: as `find_record`, or the saved state is missing, damaged
      or does not fit the record.
  """
  record = find_record(train_dir, step, worker, number)
  directory = os.path.join(train_dir, record["state_dir"])
  tower = (record.get("replay") or {}).get("tower", 0)
  params, scale, batches = _load(directory, tower)
  images, labels, ids = batches[tower]

  def dataset_fn(batch_size, seed):
    # The stored batch: the step's input pipeline (its data files) is not
    # needed, and may be gone.
    del batch_size, seed
    return tf.data.Dataset.from_tensors((images, labels, ids)).repeat()

  with tf.Graph().as_default():
    strategy = local_replication.Local(params)
    # Probes whatever the saved params say: a replay is this binary's job.
    built = train_step.build_step(params, strategy, dataset_fn=dataset_fn,
                                  replays=True)
    config = towers.session_config(strategy.tower_config)
    with tf1.Session(config=config) as session:
      session.run(tf1.local_variables_initializer())
      built.forensics.saver.restore(
          session, os.path.join(directory, forensics.CHECKPOINT_PREFIX))
      band = (record.get("replay") or {}).get("band")
      if band:  # An outlier's: its norm against the other batches'.
        explained = outlier_replay.explain(session, built.forensics, tower,
                                           batches, band, scale)
      else:
        explained = replay_lib.explain(session, built.forensics, tower,
                                       batches[tower], scale)
  return record, explained, replay_lib.line(step, explained)
