"""Which checkpoint a rollback restores (`checkpoint_rollback.RollbackHook`).

The newest intact, finite checkpoint before the streak with few enough
applied steps, among the current model's ancestors: a checkpoint written in
a window an earlier rollback abandoned holds a model that was thrown away.

The ancestry comes from the checkpoints themselves. Each one holds
`rollbacks` (the rollbacks done when it was written) and `rollback_to_step`
(the checkpoint the last of them restored), so the model's history is a
chain of lineages, newest first: the checkpoints written since the last
rollback (they hold the current `rollbacks`); then, up to the checkpoint
that rollback restored, those of the lineage it was written in (its own
`rollbacks`); then up to the checkpoint *it* descends from (its own
`rollback_to_step`), and so on. A checkpoint of an abandoned window holds
a `rollbacks` on that chain but a step past the link, or a `rollbacks` the
chain skips (a rollback that went back past an earlier one).

Why not `rollback_windows.jsonl`: it is appended before the restore, so it
also lists a rollback that a SIGKILL cut before any checkpoint recorded it;
the restarted run, resumed from a checkpoint before it, may never redo it,
and the checkpoints it writes inside that window are ancestors. The
checkpoints say only what happened to the model they hold.

`keep_checkpoint_max` keeps enough checkpoints for one to qualify;
`no_checkpoint_reason` says, in the flags' terms, why none did.
"""

import math
import os

import tensorflow as tf

from tf1_safe_train.trainer.recovery import checkpoint_rollback_state
from tf1_safe_train.trainer.checkpoint import checkpoints

tf1 = tf.compat.v1


def _read(reader, names, name, default):
  return int(reader.get_tensor(name)) if name in names else default


def _rollback_state(path):
  """(rollbacks, rollback_to_step) held by checkpoint `path`, or None.

  A checkpoint written without rollback (e.g. by a run that gave up with
  --on_persistent_skips=stop) holds none: no rollback yet (0, -1).
  """
  try:
    reader = tf1.train.NewCheckpointReader(path)
    names = reader.get_variable_to_shape_map()
    return (_read(reader, names, "rollbacks", 0),
            _read(reader, names, "rollback_to_step", -1))
  except Exception:  # pylint: disable=broad-except
    return None


def lineages(train_dir, on_disk, rollbacks, rollback_to_step):
  """[(rollbacks, last step or None)]: the current model's ancestry.

  A checkpoint is an ancestor iff it holds one of these `rollbacks` and a
  step at most its bound (None: no bound, the current lineage).

  Args:
    train_dir: the run's directory.
    on_disk: `checkpoints.on_disk(train_dir)`.
    rollbacks, rollback_to_step: the current model's rollback state.
  """
  chain = [(rollbacks, None)]
  later, link = rollbacks, rollback_to_step
  while link >= 0:
    state = (_rollback_state(os.path.join(train_dir, on_disk[link]))
             if link in on_disk else None)
    # Both strictly decrease along a genuine chain: anything else is damage.
    if state is None or not state[0] < later or not state[1] < link:
      # The link is pruned (keep_checkpoint_max: older ones went first) or
      # unreadable. What it held is unknown; the lineage just before the
      # rollback that restored it (`later` - 1) is still certain: its
      # checkpoints up to the link are ancestors (if the link came from an
      # older lineage, that one has no checkpoint at or before the link).
      # Nothing older is trusted.
      if later > 0:
        chain.append((later - 1, link))
      break
    chain.append((state[0], link))
    later, link = state
  return chain


def _ancestors(train_dir, rollbacks, rollback_to_step):
  """(step, path, applied_steps) of each readable checkpoint of `train_dir`
  that is an ancestor of the current model (`lineages`), newest first."""
  on_disk = checkpoints.on_disk(train_dir)
  chain = lineages(train_dir, on_disk, rollbacks, rollback_to_step)
  for step, name in sorted(on_disk.items(), reverse=True):
    path = os.path.join(train_dir, name)
    try:
      reader = tf1.train.NewCheckpointReader(path)
      names = reader.get_variable_to_shape_map()
      applied = _read(reader, names, "applied_steps", None)
      written_after = _read(reader, names, "rollbacks", 0)
    except Exception:  # pylint: disable=broad-except
      continue  # Damaged: an older one may do.
    if applied is not None and any(
        written_after == r and (bound is None or step <= bound)
        for r, bound in chain):
      yield step, path, applied


def choose_checkpoint(train_dir, at_step, max_applied, rollbacks,
                      rollback_to_step):
  """The checkpoint a rollback restores: (path, global_step, applied_steps).

  The newest intact checkpoint of `train_dir` before `at_step` holding at
  most `max_applied` applied steps, among the ancestors of the current
  model (`lineages`), however many rollbacks ago they were written.

  Returns:
    (path, step, applied), or (None, reason, None).
  """
  for step, path, applied in _ancestors(train_dir, rollbacks,
                                        rollback_to_step):
    if (step < at_step and applied <= max_applied and
        checkpoints.damage(path, require_finite=True) is None):
      return path, step, applied
  return None, "no intact checkpoint of %s qualifies" % train_dir, None


def last_good(train_dir, applied, rollbacks, rollback_to_step,
              trust_restored):
  """The last good checkpoint of a run that gave up: (path, restored).

  "Good" follows the run's history, not the step numbers: among the
  current model's ancestors (never a checkpoint of a window a rollback
  abandoned), the newest intact one written before the last update the
  model holds (fewer applied steps than its `applied`), which may have
  wrecked it (finite weights on which every batch fails): the checkpoints
  since hold the weights the streak failed on. If no step was applied
  since the last rollback, the checkpoint it restored, when
  `trust_restored` (--rollback_min_applied_steps > 0: the run had applied
  steps after it before, which is why the rollback chose it).

  Args:
    train_dir: the run's directory.
    applied: the model's applied steps (during a streak, when it began).
    rollbacks, rollback_to_step: the model's rollback state (0, -1: none).
    trust_restored: whether the restored checkpoint counts as good.

  Returns:
    (path, restored: it is the checkpoint the last rollback restored), or
    (None, False).
  """
  for step, path, held in _ancestors(train_dir, rollbacks, rollback_to_step):
    restored = trust_restored and rollbacks > 0 and step == rollback_to_step
    if ((held < applied or restored) and
        checkpoints.damage(path, require_finite=True) is None):
      return path, restored and held == applied
  return None, False


def last_good_chooser(params, applied_steps):
  """`choose(sess)` for `last_good.SparingSaver`: the path of the run's
  last good checkpoint now (`last_good`), or None.

  Args:
    params: the run's `params.TrainParams`.
    applied_steps: the run's `applied_steps` variable.
  """
  reads = [applied_steps]
  if params.on_persistent_skips == "rollback":
    state = checkpoint_rollback_state.state()
    reads += [state.rollbacks, state.rollback_to_step]

  def choose(sess):
    applied, *history = sess.run(reads)
    rollbacks, to_step = history or (0, -1)
    return last_good(params.train_dir, int(applied), int(rollbacks),
                     int(to_step), params.rollback_min_applied_steps > 0)[0]
  return choose


def keep_checkpoint_max(params):
  """How many checkpoints to keep: enough for a rollback to find one.

  When the streak reaches --max_consecutive_skips (K), the checkpoint needed
  was written M = --rollback_min_applied_steps applied steps before the
  streak began, so up to ceil((M + K) / save_checkpoints_steps) intervals
  ago; two more cover the start-up save and the one being written. Skips
  before the streak push it further back; then no checkpoint may qualify
  and the run stops as without rollback, saying so.
  """
  if params.on_persistent_skips != "rollback":
    return 5
  return max(5, math.ceil(
      (params.rollback_min_applied_steps + params.max_consecutive_skips) /
      params.save_checkpoints_steps) + 2)


def no_checkpoint_reason(params, applied):
  """Why no checkpoint can be rolled back to, in the flags' terms (a clause).

  Args:
    params: the run's `params.TrainParams`.
    applied: the run's applied steps when its streak began.
  """
  needed = params.rollback_min_applied_steps
  head = ("the run has %d applied steps, and a rollback needs a checkpoint "
          "written at least %d applied steps before the skip streak "
          "(--rollback_min_applied_steps=%d)" % (applied, needed, needed))
  if applied < needed:
    return head + "; there can be none yet: lower --rollback_min_applied_steps"
  return head + (", one with at most %d; %s holds no intact one: lower "
                 "--rollback_min_applied_steps or save checkpoints more "
                 "often (--save_checkpoints_steps=%d)" % (
                     applied - needed, params.train_dir,
                     params.save_checkpoints_steps))
