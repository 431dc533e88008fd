"""Device quarantine (`--quarantine_after=K`): a tower that keeps failing
without reproducing is left out of the rest of the run.

Each fault of a tower whose replay is finite (verdict "suspect device")
adds one to its count, a checkpointed variable; at K the tower is
quarantined: the run stops its session and rebuilds the step without it
(none of its nodes runs, its input is never read), and a restart keeps it
until `--clear_quarantine`. Reproducible faults (the data) never count.

The decision is durable before it is announced: `<train_dir>/quarantine.json`
(written atomically and fsynced before the line) lists the quarantined
towers in the order decided, so a SIGKILL right after the line loses
nothing, though the counts live only in the checkpoint the segment's end
writes. A restart (or the rebuild) applies the run's rules to that state:
the recorded towers, then any other at K, each only while the floor
(`min_active` towers left) allows, as the run itself would have.
"""

import json
import os

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import criteria
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.checkpoint import checkpoints
from tf1_safe_train.trainer.run import train_dir as train_dir_lib

tf1 = tf.compat.v1

FAULTS = "suspect_faults_by_tower"
RECORD = "quarantine.json"


def _recorded(train_dir, num_towers, clear):
  """The towers `<train_dir>/quarantine.json` lists, in decision order
  ([] if `clear`).

  Raises:
    train_dir_lib.TrainDirError: it is not a file (even if `clear`: it is
      rewritten), or unreadable, or not a record of ours.
  """
  path = os.path.join(train_dir, RECORD)
  problem = skip_log.file_problem(path)
  if problem:
    raise train_dir_lib.TrainDirError(
        "%s %s: remove it (a run writes a file there)" % (path, problem))
  if clear:
    return []
  try:
    with open(path) as f:
      towers = json.load(f).get("towers")
  except FileNotFoundError:
    return []
  except (OSError, ValueError, AttributeError) as e:
    towers = e
  if not (isinstance(towers, list) and all(
      isinstance(t, int) and not isinstance(t, bool) and t >= 0
      for t in towers)):
    raise train_dir_lib.TrainDirError(
        "%s is not a quarantine record (%s); --clear_quarantine starts over"
        % (path, towers if isinstance(towers, Exception)
           else "expected {\"towers\": [tower indices]}"))
  # (Another --num_towers is refused by the checkpoint's own checks.)
  return [t for t in towers if t < num_towers]


def _record(train_dir, towers, devices):
  """Writes the quarantined `towers` atomically; durable when it returns."""
  path = os.path.join(train_dir, RECORD)
  with open(path + ".tmp", "w") as f:
    json.dump({"towers": list(towers),
               "devices": [devices[t] for t in towers]}, f, sort_keys=True)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)
  directory = os.open(train_dir, os.O_RDONLY)
  try:
    os.fsync(directory)  # The rename itself.
  finally:
    os.close(directory)


def _counts_in(train_dir, num_towers):
  """Each tower's count in the newest checkpoint (zeros if none has it)."""
  checkpoint = checkpoints.latest(train_dir)
  if checkpoint is None:
    return [0] * num_towers
  reader = tf1.train.load_checkpoint(checkpoint)
  if FAULTS not in reader.get_variable_to_shape_map():
    return [0] * num_towers
  counts = [int(c) for c in np.reshape(reader.get_tensor(FAULTS), [-1])]
  # (Another --num_towers is refused by the checkpoint's own checks.)
  return counts if len(counts) == num_towers else [0] * num_towers


class Quarantine(object):
  """The quarantine of one run segment (a session; see `train_lib`).

  Attributes:
    quarantined: the tower indices the step is built without.
    restart: True once a tower was quarantined in this segment: the runner
      rebuilds the step without it.
  """

  def __init__(self, params, devices, min_active, clear):
    """Reads the record and the counts (unless `clear`), decides as the
    run did (the module doc), records that and logs the startup line.

    Args:
      params: the run's `params.TrainParams` (quarantine_after > 0).
      devices: every tower's device string.
      min_active: never quarantine below this many towers.
      clear: --clear_quarantine: start from zero counts, nothing recorded.
    """
    self._after = params.quarantine_after
    self._devices = list(devices)
    self._min_active = min_active
    self._clear = clear
    self._train_dir = params.train_dir
    num_towers = len(devices)
    recorded = _recorded(params.train_dir, num_towers, clear)
    counts = ([0] * num_towers if clear
              else _counts_in(params.train_dir, num_towers))
    self.quarantined = ()
    for t in recorded + [t for t, c in enumerate(counts)
                         if c >= self._after and t not in recorded]:
      if self._left_if(t, max(counts[t], self._after)):
        self.quarantined += (t,)
    if list(self.quarantined) != recorded or (
        clear and os.path.exists(os.path.join(params.train_dir, RECORD))):
      _record(params.train_dir, self.quarantined, self._devices)
    self.restart = False
    # Replays a tower gets past --max_explained_skips (this segment): at
    # most K each, whatever their verdicts, so the cost stays bounded.
    self._forced = [0] * num_towers
    self._counts = None
    self._increments = None
    self._reset = None
    if self.quarantined:
      logging.warning("quarantined towers (--quarantine_after=%d, kept from "
                      "the checkpoint; --clear_quarantine starts over): %s",
                      self._after, self._names(self.quarantined))

  def _left_if(self, tower, faults):
    """Whether quarantining `tower` (at `faults`) leaves the floor's towers
    (--min_healthy_towers, at least 2); if not, says so."""
    left = len(self._devices) - len(self.quarantined) - 1
    if left >= self._min_active:
      return True
    logging.warning(
        "tower %s: %d faults that did not reproduce, but not quarantined: "
        "%d towers would be left (--min_healthy_towers, at least 2)",
        self._names([tower]), faults, left)
    return False

  def _names(self, towers):
    return ", ".join("%d (%s)" % (t, self._devices[t]) for t in towers)

  def build(self, variables_device):
    """Adds the counts and their ops to the default graph (before the
    session finalises it)."""
    num_towers = len(self._devices)
    with tf1.device(variables_device):
      counts = tf1.Variable(
          tf.zeros([num_towers], tf.int64), trainable=False, name=FAULTS,
          collections=[tf1.GraphKeys.GLOBAL_VARIABLES, criteria.OPTIONAL_STATE])
      self._increments = [
          tf1.assign_add(counts, tf.one_hot(t, num_towers, dtype=tf.int64))
          for t in range(num_towers)]
      self._reset = tf1.assign(counts, tf.zeros([num_towers], tf.int64))
    self._counts = counts

  def hook(self):
    """The hook that clears the counts after a restore (--clear_quarantine)."""
    return _ClearHook(self._reset if self._clear else None)

  def wants_replay(self, tower):
    """Whether tower `tower` gets a replay past --max_explained_skips."""
    if self._forced[tower] >= self._after:
      return False
    self._forced[tower] += 1
    return True

  def on_suspect(self, run_context, tower):
    """Counts a fault of `tower` that did not reproduce; at K, quarantines
    it (stops this session: the runner rebuilds the step without it)."""
    counts = run_context.session.run(self._increments[tower])
    if (counts[tower] < self._after or self.restart or
        not self._left_if(tower, counts[tower])):
      return
    # Durable before announced: a kill right after the line keeps it.
    _record(self._train_dir, self.quarantined + (tower,), self._devices)
    logging.warning(
        "tower %s quarantined: %d faults that did not reproduce on replay "
        "(--quarantine_after=%d); left out of every later step (the step is "
        "rebuilt without it)", self._names([tower]), counts[tower],
        self._after)
    self.restart = True
    run_context.request_stop()


class _ClearHook(tf1.train.SessionRunHook):

  def __init__(self, reset):
    self._reset = reset

  def after_create_session(self, session, coord):
    del coord
    if self._reset is not None:
      session.run(self._reset)
