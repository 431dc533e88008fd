"""The last good checkpoint of a skip streak, spared by pruning.

A skip changes nothing, so every checkpoint written during a skip streak
holds the weights the streak's steps failed on. If the last applied step
wrecked the model (finite weights on which every batch fails), none of them
is good: the newest checkpoint written before that step is, in the run's
history (after a rollback, never one of the window it abandoned:
`checkpoint_rollback_target.last_good`, which finds it on disk for the
give-up line). `SparingSaver` prunes as `tf1.train.Saver` does (the newest
`max_to_keep`) but never deletes that checkpoint while the streak lasts.
"""

import os
import re

import tensorflow as tf

tf1 = tf.compat.v1

_NAME = re.compile(r"^model\.ckpt-(\d+)$")


def step_of(path):
  """The global step in a `model.ckpt-N` path's name, or None."""
  match = _NAME.match(os.path.basename(path))
  return int(match.group(1)) if match else None


def streak_start(global_step, consecutive_skips, skips_advance_step=True):
  """Int64 tensor: the global step the current skip streak began at, or -1
  (no streak), from the step's variables (`SparingSaver`'s `streak_start`).

  Args:
    global_step, consecutive_skips: the run's variables.
    skips_advance_step: whether skipped steps advance global_step
      (--increment_global_step_on_skip).
  """
  step = global_step.read_value()
  streak = consecutive_skips.read_value()
  start = step - streak if skips_advance_step else step
  return tf.where(streak > 0, start, tf.constant(-1, start.dtype))


class SparingSaver(tf1.train.Saver):
  """A `Saver` whose pruning spares the last checkpoint before a streak.

  Call `note_streak(sess)` before each `save`: the checkpoint it spares is
  the newest this saver wrote before the last step applied before the
  current streak (written at a global step below the streak's start), and
  none without a streak. The newest `max_to_keep` others are kept too.
  """

  def __init__(self, streak_start=None, choose=None, **kwargs):
    """Creates the saver.

    Args:
      streak_start: an int64 tensor (`streak_start`), or None: prunes as
        `tf1.train.Saver`.
      choose: optional `choose(sess)`, the path of the last good checkpoint
        of the run's history during a streak, or None
        (`checkpoint_rollback_target.last_good_chooser`); without it, the
        newest checkpoint before the streak's start by step number.
      **kwargs: `tf1.train.Saver` arguments.
    """
    super().__init__(**kwargs)
    self._streak_start = streak_start
    self._choose = choose
    self._keep = None  # The basename pruning spares, or None.

  def note_streak(self, sess):
    """Reads the streak's start: which checkpoint the next save spares."""
    if self._streak_start is None:
      return
    start = int(sess.run(self._streak_start))
    if start >= 0 and self._choose is not None:
      path = self._choose(sess)
      self._keep = os.path.basename(path) if path else None
      return
    names = [os.path.basename(self._CheckpointFilename(p))
             for p in self._last_checkpoints]
    before = [(step_of(n), n) for n in names
              if start >= 0 and step_of(n) is not None and
              step_of(n) < start]
    self._keep = max(before)[1] if before else None

  def _spared(self, entry):
    return os.path.basename(self._CheckpointFilename(entry)) == self._keep

  # The Saver's own pruning bookkeeping, called by its `save`.
  # pylint: disable=invalid-name
  def _RecordLastCheckpoint(self, latest_save_path):
    super()._RecordLastCheckpoint(latest_save_path)
    if not self.saver_def.max_to_keep:
      return
    pending, kept = self._checkpoints_to_be_deleted, self._last_checkpoints
    for entry in [e for e in pending if self._spared(e)]:
      pending.remove(entry)
      kept.insert(0, entry)
    others = [e for e in kept if not self._spared(e)]
    for entry in others[:max(0, len(others) - self.saver_def.max_to_keep)]:
      kept.remove(entry)
      pending.append(entry)

  def _MaybeDeleteOldCheckpoints(self, meta_graph_suffix="meta"):
    while self._checkpoints_to_be_deleted:  # The base deletes one a call.
      super()._MaybeDeleteOldCheckpoints(meta_graph_suffix=meta_graph_suffix)
  # pylint: enable=invalid-name
