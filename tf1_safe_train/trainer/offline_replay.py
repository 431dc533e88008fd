"""Re-running a recorded skip after the run: what `//:replay` does.

An explained skip saved `<train_dir>/skips/step-N/` (`forensics`): the state
the step saw (exact: a skip moves nothing), every tower's batch and the
run's params. `replay_recorded` rebuilds the step's graph from those params
on this machine (towers on devices that do not exist fall back to the CPU),
restores that state and replays the recorded tower's batch as the run did.
"""

import json
import os

import tensorflow as tf

from tf1_safe_train.cluster import replication
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer import forensics
from tf1_safe_train.trainer import params as params_lib
from tf1_safe_train.trainer import replay_lib
from tf1_safe_train.trainer import towers
from tf1_safe_train.trainer import train_step

tf1 = tf.compat.v1


class ReplayError(ValueError):
  """The skip cannot be replayed; the message says why in one line."""


def find_record(train_dir, step, worker=0):
  """The record of `step` in `worker`'s log of `train_dir`.

  Raises:
    ReplayError: no such directory, log or step, or the skip was not
      explained (no saved state).
  """
  if not os.path.isdir(train_dir):
    raise ReplayError("--train_dir=%s: no such directory" % train_dir)
  log = skip_log.path(train_dir, worker)
  if not os.path.exists(log):
    raise ReplayError("%s: no such file (no skip recorded by worker %d)" %
                      (log, worker))
  try:
    records = skip_log.read(log)
  except skip_log.SkipLogError as e:
    raise ReplayError(str(e))
  by_step = {r["step"]: r for r in records}
  if step not in by_step:
    steps = sorted(by_step)
    raise ReplayError("%s records no skip of step %d (recorded: %s)" % (
        log, step, ", ".join(str(s) for s in steps[:20]) +
        (", ..." if len(steps) > 20 else "") if steps else "none"))
  record = by_step[step]
  if not record.get("state_dir"):
    raise ReplayError("step %d was recorded but not explained (%s): no "
                      "saved state to replay" % (
                          step, record.get("verdict", "no verdict")))
  return record


def _load(directory):
  """(params, loss scale, batches) saved in a skip's directory."""
  for name in (forensics.PARAMS_FILE, forensics.BATCH_FILE,
               forensics.CHECKPOINT_PREFIX + ".index"):
    if not os.path.exists(os.path.join(directory, name)):
      raise ReplayError("%s: missing %s (the skip's saved state is "
                        "incomplete)" % (directory, name))
  with open(os.path.join(directory, forensics.PARAMS_FILE)) as f:
    saved = json.load(f)
  try:
    params = params_lib.TrainParams(**saved["params"]).validate()
  except (TypeError, params_lib.ParamsError) as e:
    raise ReplayError("%s: params of another version of the trainer (%s)" %
                      (directory, e))
  return params, saved.get("loss_scale"), forensics.load_batches(directory)


def replay_recorded(train_dir, step, worker=0):
  """Replays a recorded skip; returns (record, explanation, log line).

  Raises:
    ReplayError: as `find_record`, or the saved state is missing.
  """
  record = find_record(train_dir, step, worker)
  directory = os.path.join(train_dir, record["state_dir"])
  params, scale, batches = _load(directory)
  tower = (record.get("replay") or {}).get("tower", 0)
  images, labels, ids = batches[tower]

  def dataset_fn(batch_size, seed):
    # The stored batch: the step's input pipeline (its data files) is not
    # needed, and may be gone.
    del batch_size, seed
    return tf.data.Dataset.from_tensors((images, labels, ids)).repeat()

  with tf.Graph().as_default():
    strategy = replication.Local(params)
    built = train_step.build_step(params, strategy, dataset_fn=dataset_fn)
    config = towers.session_config(strategy.tower_config)
    with tf1.Session(config=config) as session:
      session.run(tf1.local_variables_initializer())
      built.forensics.saver.restore(
          session, os.path.join(directory, forensics.CHECKPOINT_PREFIX))
      explained = replay_lib.explain(session, built.forensics, tower,
                                     batches[tower], scale)
  return record, explained, replay_lib.line(step, explained)
