"""A synchronous worker's statistics writes, gated on their finiteness.

In `SkipNonFiniteOptimizer(SyncReplicasOptimizer(opt))` a worker's update
ops (batch-norm moving statistics) write the shared variables on the ps in
the worker's run, before the chief decides on the aggregate: a non-finite
value written there would stay until the worker's rollback after its token,
where any checkpoint the chief saves meanwhile reads it. Here each such
write is rewired to leave its variable as it was unless the new value is
finite and so are the worker's own gradients (when they do not depend on
the write): a non-finite value never reaches the ps. And the worker can
only roll back a finite write the chief then skipped if its token comes
after that decision: `no_spare_tokens` makes SyncReplicas' default so.
"""

from absl import logging
import tensorflow as tf

from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import shadows
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

# The writes gated: `var += sign * value`; 0 for `var = value`.
_SIGNS = {"AssignSub": -1, "AssignSubVariableOp": -1,
          "AssignAdd": 1, "AssignAddVariableOp": 1,
          "Assign": 0, "AssignVariableOp": 0}


def gate(sync, updates, grads):
  """Rewires the writes of `updates` to keep their variables unless finite.

  A kept variable is written its old value (an add of zeros, or an assign
  of the value read), so the op, its consumers and the worker's rollback
  stay as they were. The check reads the variable when the write's value
  is computed: another worker's write between the two is not seen (both
  are finite, being gated alike).

  Args:
    sync: the `SyncReplicasOptimizer`: with writes, `no_spare_tokens`.
    updates: the worker's update ops (Operations).
    grads: the worker's own gradients (Tensors, IndexedSlices, None ok).
      A write they depend on (batch norm's statistics assigned in the
      forward pass) is gated on its value alone: gating it on them would
      make a cycle.

  Returns:
    (ok, ungated): a bool scalar, True if every gated write wrote (its
    values and, where gated on them, the gradients were finite); the
    (op, variable) pairs not gated (scatters, writes in a cond): those
    the worker's rollback alone protects.
  """
  written, _ = writes.find_writes(updates)
  grads = [g for g in grads if g is not None]
  gated = [(op, v) for op, v in written
           if op.type in _SIGNS and not writes.in_control_flow(op)]
  ungated = [(op, v) for op, v in written if (op, v) not in gated]
  if written:
    no_spare_tokens(sync)
  if not gated:
    return tf.constant(True), ungated
  with tf1.control_dependencies(None), tf1.name_scope("sync_worker_gate"):
    grads_ok = tf.logical_not(nonfinite.any_nonfinite(grads))
    under_grads = fetch_gate.ancestors(
        [t.op for t in tf.nest.flatten(grads, expand_composites=True)])
    oks = [_write_if_finite(op, variable,
                            None if op in under_grads else grads_ok)
           for op, variable in gated]
    return tf.reduce_all(tf.stack(oks), name="statistics_written"), ungated


def _write_if_finite(op, variable, grads_ok):
  """Rewires `op` to write only if its new value is finite and `grads_ok`
  (None: no condition); returns that condition."""
  value = op.inputs[1]
  with tf1.device(variable.device):  # (The write's: on the ps.)
    old = shadows.read_written(variable)
    sign = _SIGNS[op.type]
    new = value if not sign else (old + value if sign > 0 else old - value)
    ok = tf.logical_not(nonfinite.is_nonfinite(new))
    if grads_ok is not None:
      ok = tf.logical_and(ok, grads_ok)
    kept = tf.zeros_like(value) if sign else tf.identity(old)
    # The op is the user's (built before the wrapper saw it); rewiring its
    # value input is the only way to keep a write a legacy script runs
    # itself (a `tf.group` of UPDATE_OPS) off the ps.
    op._update_input(1, tf.where(ok, value, kept))  # pylint: disable=protected-access
  return ok


def no_spare_tokens(sync):
  """Makes `sync`'s token calls default to no spare token, told otherwise.

  A spare token (`num_tokens=-1`, SyncReplicas' default: one per replica
  to aggregate; `slim.learning.train` takes it) can reach a worker before
  the aggregate its push joined is decided: its statistics then follow its
  own finiteness (never NaN, gated), not the chief's skip. Without spare
  tokens every token follows the decision of the worker's aggregate (the
  workers do not run one step ahead). Where SyncReplicas needs spare
  tokens (more replicas to aggregate than replicas) it is told at once.
  """
  # pylint: disable=protected-access
  needed = sync._replicas_to_aggregate - sync._total_num_replicas
  if needed > 0:
    _tell(needed)
    return
  init_tokens, make_hook = sync.get_init_tokens_op, sync.make_session_run_hook

  def get_init_tokens_op(num_tokens=0):
    _tell(num_tokens)
    return init_tokens(num_tokens)

  def make_session_run_hook(is_chief, num_tokens=0):
    _tell(num_tokens)
    return make_hook(is_chief, num_tokens)

  # On the instance, so the calls of code given `opt.wrapped_optimizer`
  # (`slim.learning.train`) take this default too.
  sync.get_init_tokens_op = get_init_tokens_op
  sync.make_session_run_hook = make_session_run_hook


def _tell(num_tokens):
  if num_tokens:
    logging.warning(
        "SkipNonFiniteOptimizer(SyncReplicasOptimizer(...)): with spare "
        "tokens (num_tokens=%d) a worker's token can come before its "
        "aggregate is decided: its update ops' statistics then follow its "
        "own finiteness, not the chief's skip (never non-finite, but not "
        "bit-identical on a skip); num_tokens=0 keeps them", num_tokens)
