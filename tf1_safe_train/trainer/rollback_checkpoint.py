"""Which checkpoint a rollback restores (`recovery.RollbackHook`).

The newest intact, finite checkpoint before the streak with few enough
applied steps, among the current model's ancestors: a checkpoint written in
a window an earlier rollback abandoned holds a model that was thrown away.
"""

import os

import tensorflow as tf

from tf1_safe_train.trainer import checkpoints

tf1 = tf.compat.v1


def _read(reader, names, name, default):
  return int(reader.get_tensor(name)) if name in names else default


def choose_checkpoint(train_dir, at_step, max_applied, rollbacks,
                      rollback_to_step):
  """The checkpoint a rollback restores: (path, global_step, applied_steps).

  The newest intact checkpoint of `train_dir` before `at_step` holding at
  most `max_applied` applied steps, among the ancestors of the current
  model: those written since the last rollback (they hold `rollbacks`),
  and those before it up to the one it restored (`rollback_to_step`); the
  checkpoints in between come from the abandoned window.

  Returns:
    (path, step, applied), or (None, reason, None).
  """
  for step, name in sorted(checkpoints.on_disk(train_dir).items(),
                           reverse=True):
    if step >= at_step:
      continue
    path = os.path.join(train_dir, name)
    try:
      reader = tf1.train.NewCheckpointReader(path)
      names = reader.get_variable_to_shape_map()
      applied = _read(reader, names, "applied_steps", None)
      written_after = _read(reader, names, "rollbacks", 0)
    except Exception:  # pylint: disable=broad-except
      continue  # Damaged: an older one may do.
    ancestor = (written_after == rollbacks or
                (written_after == rollbacks - 1 and step <= rollback_to_step))
    if (ancestor and applied is not None and applied <= max_applied and
        checkpoints.damage(path, require_finite=True) is None):
      return path, step, applied
  return None, "no intact checkpoint of %s qualifies" % train_dir, None
