"""Checkpoint bookkeeping of a train_dir: what to resume from, what to save.

A train_dir is self-contained: its `checkpoint` state file names checkpoints
by basename, resolved against the train_dir itself (a copied or moved run
never restores from, nor prunes, the directory it came from). Before a run
resumes, `prepare_resume` picks the state file's latest checkpoint if it is
intact, else the newest intact `model.ckpt-N` present (a truncated, zeroed
or non-finite one, a missing state file, a state file pointing elsewhere
each cost one warning line, never the run), and `checkpoint_fit` names the
variable a different model or flag would fail on. `FiniteSaver` never writes
a checkpoint holding a non-finite value.
"""

import contextlib
import json
import os
import re

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import shadows
from tf1_safe_train.trainer.checkpoint import checkpoint_fit
from tf1_safe_train.trainer.checkpoint import finite_state
from tf1_safe_train.trainer.checkpoint import last_good

tf1 = tf.compat.v1

STATE_FILE = "checkpoint"
BASENAME = "model.ckpt"
_INDEX = re.compile(r"^%s-(\d+)\.index$" % re.escape(BASENAME))


class CheckpointError(ValueError):
  """A train_dir's checkpoints cannot be resumed; the message says why."""


def damage(prefix, require_finite=False):
  """Why the checkpoint at `prefix` cannot be restored, or None if intact.

  Every tensor is read: a truncated or zeroed data file shows only then.

  Args:
    prefix: the checkpoint's path (`<dir>/model.ckpt-N`).
    require_finite: a floating value holding NaN or Inf is damage too (a
      checkpoint written before the trainer refused to save one).
  """
  nonfinite = []
  try:
    reader = tf1.train.NewCheckpointReader(prefix)
    for name in sorted(reader.get_variable_to_shape_map()):
      value = np.asarray(reader.get_tensor(name))
      if (require_finite and np.issubdtype(value.dtype, np.floating) and
          not np.isfinite(value).all()):
        nonfinite.append(name)
  except Exception as e:  # pylint: disable=broad-except
    # Damage shows as OpErrors, but also IndexError ("Read less bytes than
    # requested") or ValueError from the reader's C++ wrapper.
    message = getattr(e, "message", None) or str(e)
    return "%s: %s" % (type(e).__name__, message.splitlines()[0][:200])
  if nonfinite:
    return "non-finite values in %s" % finite_state.describe_names(nonfinite)
  return None


def on_disk(train_dir):
  """{step: basename} of the `model.ckpt-N` checkpoints in `train_dir`."""
  try:
    names = os.listdir(train_dir)
  except OSError:
    return {}
  steps = {}
  for name in names:
    match = _INDEX.match(name)
    if match:
      steps[int(match.group(1))] = name[:-len(".index")]
  return steps


def _listed(train_dir):
  """Basenames the state file lists (latest last), or None without one."""
  path = os.path.join(train_dir, STATE_FILE)
  if not os.path.exists(path):
    return None
  try:
    state = tf1.train.get_checkpoint_state(train_dir)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("ignoring the unreadable %s (%s)", path, e)
    return []
  if state is None:
    return []
  names = [os.path.basename(p) for p in state.all_model_checkpoint_paths]
  latest = os.path.basename(state.model_checkpoint_path)
  if latest:
    names = [n for n in names if n != latest] + [latest]
  return names


def _write_state(train_dir, latest, all_names):
  """Writes the state file with relative paths, atomically, if it changes."""
  text = "model_checkpoint_path: %s\n" % json.dumps(latest)
  text += "".join("all_model_checkpoint_paths: %s\n" % json.dumps(n)
                  for n in all_names)
  path = os.path.join(train_dir, STATE_FILE)
  try:
    with open(path) as f:
      if f.read() == text:
        return
  except OSError:
    pass
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def _candidates(listed, steps):
  """Basenames to resume from, best first.

  The state file's latest (if in the directory: a crash between a
  checkpoint's files and the state file's update resumes as TensorFlow
  would), then every checkpoint present, newest first.
  """
  names = [listed[-1]] if listed and listed[-1] in steps.values() else []
  return names + [steps[s] for s in sorted(steps, reverse=True)
                  if steps[s] not in names]


def prepare_resume(train_dir, variables=None, params=None):
  """Points the state file at the checkpoint `train_dir` resumes from.

  That is the state file's latest if intact (readable and finite), else the
  newest intact checkpoint present (a warning line names what was wrong).

  Only checkpoints the state file listed (and the one resumed from) are
  listed again, so pruning never deletes checkpoints the run did not keep.

  Args:
    train_dir: the run's directory (this trainer holds its lock).
    variables: optional variables the run restores, checked against the
      checkpoint (`checkpoint_fit.mismatch`) with `params`.
    params: the run's `params.TrainParams` (with `variables`).

  Returns:
    The path of the checkpoint the run will resume from, or None (fresh).

  Raises:
    CheckpointError: checkpoints are present but none is intact, or (with
      `variables`) the checkpoint does not fit them.
  """
  steps = on_disk(train_dir)
  listed = _listed(train_dir)
  state_path = os.path.join(train_dir, STATE_FILE)
  if not steps:
    if listed:
      # E.g. a copy of a run without its checkpoint files: the state file
      # would restore from wherever its absolute paths point.
      logging.warning("%s lists checkpoints not in %s (%s): starting from "
                      "step 0", state_path, train_dir, listed[-1])
      os.remove(state_path)
    return None
  bad = []
  for name in _candidates(listed, steps):
    reason = damage(os.path.join(train_dir, name), require_finite=True)
    if reason is None:
      break
    bad.append("%s (%s)" % (name, reason))
  else:
    raise CheckpointError(
        "--train_dir=%s holds checkpoints but none is intact (%s); move "
        "them away to start afresh" % (train_dir, "; ".join(bad)))
  if bad:
    logging.warning("skipping damaged checkpoint%s %s: resuming from %s",
                    "s" if len(bad) > 1 else "", "; ".join(bad), name)
  elif listed is None:
    logging.warning("%s is missing: resuming from %s, the newest intact "
                    "checkpoint present", state_path, name)
  elif listed and listed[-1] != name:
    logging.warning("%s names %s as the latest checkpoint: resuming from %s, "
                    "the newest intact one in %s", state_path, listed[-1],
                    name, train_dir)
  step = int(name.rsplit("-", 1)[1])
  kept = [n for n in (listed or []) if n in steps.values() and n != name and
          int(n.rsplit("-", 1)[1]) < step]
  path = os.path.join(train_dir, name)
  if variables is not None:
    problem = checkpoint_fit.mismatch(path, variables, params)
    if problem:
      raise CheckpointError(problem)
  _write_state(train_dir, name, kept + [name])
  return path


def latest(train_dir):
  """The newest intact checkpoint of `train_dir` (its path), or None.

  The state file's choice first (resolved inside `train_dir`), else the
  newest intact `model.ckpt-N` present. Reads only.
  """
  steps = on_disk(train_dir)
  for name in _candidates(_listed(train_dir), steps):
    path = os.path.join(train_dir, name)
    if damage(path) is None:
      return path
  return None


class FiniteSaver(last_good.SparingSaver):
  """A `Saver` that refuses to save a non-finite state.

  Every checkpoint hook saves through the scaffold's saver (on one machine
  MonitoredTrainingSession's, in a cluster the chief's), and a
  `CheckpointSaverListener` cannot cancel a save: so the check sits here.
  A refused save writes nothing, returns None and calls `on_refuse(step,
  names)` (e.g. `finite_state.NonFiniteStateHook.refuse_save`, which stops
  the run); the last checkpoint is still the last good state.
  """

  def __init__(self, check, on_refuse, fresh=(), streak_start=None,
               lock=None, **kwargs):
    """Creates the saver.

    Args:
      check: a `finite_state.FiniteStateCheck`.
      on_refuse: `on_refuse(step, names)`, called for each refused save.
      fresh: variables of `var_list` (a dict) that a restore initialises
        when the checkpoint lacks them (`checkpoint_fit.fresh_variables`).
      streak_start: optional int64 tensor: the global step the current
        skip streak began at, or -1 (none). Pruning never deletes the
        newest checkpoint written before it (`last_good`).
      lock: optional lock held while saving (a rollback's, which another
        thread may restore under: `checkpoint_rollback.RollbackHook.lock`).
      **kwargs: `tf1.train.Saver` arguments.
    """
    super().__init__(streak_start=streak_start, **kwargs)
    self._check = check
    self._on_refuse = on_refuse
    self._lock = lock or contextlib.nullcontext()
    self._fresh, self._restorer = list(fresh), None
    self._meta_graph = None  # (graph, arguments, MetaGraphDef, its bytes)
    if self._fresh:
      ids = {id(v) for v in self._fresh}
      self._restorer = tf1.train.Saver(
          {n: v for n, v in kwargs["var_list"].items() if id(v) not in ids},
          save_relative_paths=kwargs.get("save_relative_paths", False))
      self._fresh_init = tf1.variables_initializer(self._fresh)
      # A flat rollback shadow that starts afresh must hold the restored
      # statistics, not their initial values (see `shadows`).
      self._fresh_sync = shadows.sync_shadows(self._fresh)

  def restore(self, sess, save_path):
    names = (tf1.train.NewCheckpointReader(save_path)
             .get_variable_to_shape_map() if self._fresh else {})
    if not any(v.op.name not in names for v in self._fresh):
      return super().restore(sess, save_path)
    self._restorer.restore(sess, save_path)
    sess.run(self._fresh_init)
    if self._fresh_sync is not None:
      sess.run(self._fresh_sync)
    logging.info("restored %s, which lacks %s: they start afresh (the state "
                 "of an option this run switched on)", save_path,
                 ", ".join(v.op.name for v in self._fresh))

  def export_meta_graph(self, filename=None, **kwargs):
    """`Saver.export_meta_graph`, serialised once per finalized graph.

    A finalized graph cannot change, so every checkpoint's `.meta` is the
    same bytes; serialising a graph of towers again for each one cost up to
    0.5 s of CPU a checkpoint (//bench:end_to_end), writing them costs
    milliseconds. Each checkpoint still gets its `.meta`.
    """
    graph = tf1.get_default_graph()
    if not graph.finalized or not filename or kwargs.get("as_text"):
      return super().export_meta_graph(filename, **kwargs)
    arguments = repr(sorted(kwargs.items()))
    cached = self._meta_graph
    if cached is None or cached[0] is not graph or cached[1] != arguments:
      meta = super().export_meta_graph(None, **kwargs)
      cached = self._meta_graph = (graph, arguments, meta,
                                   meta.SerializeToString(deterministic=True))
    with tf.io.gfile.GFile(filename, "wb") as f:
      f.write(cached[3])
    return cached[2]

  def save(self, sess, save_path, global_step=None, **kwargs):
    with self._lock:
      return self._save(sess, save_path, global_step, **kwargs)

  def _save(self, sess, save_path, global_step, **kwargs):
    bad = self._check.nonfinite(sess)
    if bad:
      step = global_step
      if isinstance(global_step, (tf.Tensor, tf.Variable)):
        step = sess.run(global_step)
      step = None if step is None else int(step)
      logging.error("not saving the checkpoint of step %s: non-finite values "
                    "in %s", step, finite_state.describe_names(bad))
      self._on_refuse(step, bad)
      return None
    self.note_streak(sess)
    return super().save(sess, save_path, global_step=global_step, **kwargs)
