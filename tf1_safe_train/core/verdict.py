"""The non-finite verdict of a guarded step, and its per-tensor flags.

What `guard.decide` checks before its `tf.cond` (fused: few kernels however
many tensors) and what its skip branch computes for the report.
"""

import tensorflow as tf

from tf1_safe_train.core import guard_parts
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import rollback

tf1 = tf.compat.v1


def with_flags(branch_fn, grads, written):
  """`branch_fn` returning also the report's per-tensor flags.

  With `grads` and `written` (lists: gradients, variables written by update
  ops), for the skip branch: each is checked, the variables before
  `branch_fn(flags, update_flags)` restores them. With their numbers, for
  the apply branch: all False, which the decision proved. The skip branch
  reads only what the apply branch captures already (gradients, variables'
  handles), so a v2 cond's lowering adds no `Switch` for its checks: good
  steps run none. (Each tensor a branch captures is one input of the cond,
  one `Switch` on every step, whichever branch runs.)
  """
  def branch():
    if isinstance(grads, int):
      return branch_fn(), tf.zeros([grads], tf.bool), tf.zeros([written],
                                                                tf.bool)
    flags = nonfinite.nonfinite_flags(grads)
    update_flags = (tf.stack([nonfinite.written_is_nonfinite(v)
                              for v in written])
                    if written else tf.zeros([0], tf.bool))
    with tf1.control_dependencies([flags, update_flags]):
      return branch_fn(flags, update_flags), flags, update_flags
  return branch


class Verdict(object):
  """The non-finite verdict of a step: its gradients, the values its update
  ops wrote, and the parts' flags (`guard_parts`)."""

  def __init__(self, checked, protected, update_ops, parts):
    self.protected = protected
    self.keep_updates = next((p.keep_updates for p in parts
                              if p.keep_updates is not None), None)
    extra = [f for f in (p.nonfinite_flag() for p in parts) if f is not None]
    # The skip branch recomputes the verdict from its per-tensor flags,
    # without capturing `any_bad` (a `Switch` on every step), unless flags
    # it does not see (the parts') are in it.
    self.seen_by_flags = not extra
    # Good steps pay for the decision only: fused checks (few kernels
    # however many tensors); the report's per-tensor flags are computed by
    # the skip branch (see with_flags).
    any_bad = nonfinite.any_nonfinite([g for g, _ in checked])
    for flag in extra:
      any_bad = tf.logical_or(any_bad, flag)
    # The decision checks the values the forward-pass updates wrote, and
    # waits for those updates, so the branches see (and save or undo) them.
    # Integer variables (e.g. counters an update op bumps) cannot be NaN.
    # The same values (one concatenation per flat shadow) are what the
    # apply branch saves into the shadows: it reads no variable itself;
    # unless the update also trains one of them (an update op that writes a
    # weight, e.g. a max-norm clip): the shadow must then hold the value
    # after the update, read in the branch.
    trained = set(id(v) for _, v in checked)
    variables = self.protected.variables
    self.saved_before = not any(id(v) in trained for v in variables)
    self.checked_writes = [v for v in variables
                           if v.dtype.base_dtype.is_floating]
    self.updates = [rollback.as_op(u) for u in update_ops]
    self.written = []
    if variables:
      with tf1.control_dependencies(self.updates):
        self.written = self.protected.values()
        written_bad = nonfinite.any_written_nonfinite(
            [w for w in self.written if w.dtype.base_dtype.is_floating])
        if self.keep_updates is not None:  # Rolled back if not kept.
          written_bad = tf.logical_and(written_bad, self.keep_updates)
        any_bad = tf.logical_or(any_bad, written_bad)
    self.any_bad = any_bad

  def commit(self):
    """The apply branch's save of the written values into the shadows."""
    protected = self.protected
    commit = lambda: protected.commit(self.written if self.saved_before
                                      else None)
    if self.keep_updates is None:
      return commit()
    # Built in the nested branches: tower 0 left out, its writes undone.
    return tf.cond(self.keep_updates, guard_parts.done(commit),
                   guard_parts.done(protected.restore),
                   name="keep_updates")

  def here(self, flags, update_flags):
    """The verdict in the skip branch, from its per-tensor flags."""
    if not self.seen_by_flags:
      return self.any_bad
    return tf.reduce_any(tf.concat([flags, update_flags], 0))
