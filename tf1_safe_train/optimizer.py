"""`SkipNonFiniteOptimizer`: any tf.compat.v1 optimizer, made to skip bad steps.

It wraps an optimizer and keeps its `compute_gradients` / `apply_gradients` /
`minimize` signatures; a step whose gradients hold a NaN or an Inf changes no
variable, slot, accumulator or moving statistic, and is counted instead.
Migration is one line: `opt = SkipNonFiniteOptimizer(opt)`.
"""

import tensorflow as tf

from tf1_safe_train import guard

tf1 = tf.compat.v1

# Graph collection of the `guard.GuardResult` of every wrapped step, so hooks
# can find the applied flag and the per-variable flags of legacy train ops.
GUARD_RESULTS = "tf1_safe_train_guard_results"


class SkipNonFiniteOptimizer(tf1.train.Optimizer):
  """Wraps a `tf.compat.v1.train.Optimizer`; skips non-finite steps.

  What is protected on a skipped step: every variable the wrapped optimizer
  would update, its slots (momentum, Adam's m and v, RMSProp's ms/mom, ...)
  and non-slot accumulators (Adam's beta powers, ...), because the whole
  `apply_gradients` of the wrapped optimizer is built inside the apply branch
  of one `tf.cond`; and every variable written by the ops in the graph's
  `UPDATE_OPS` collection (batch-norm moving statistics), which run before the
  decision and are restored from a shadow copy when the step is skipped.

  What is not: ops the caller builds outside `apply_gradients` and runs in the
  same step (an EMA grouped into the train op, a hand-written assign). Put
  them under `tf.control_dependencies` of `applied()` or in the trainer's
  apply function.

  The `UPDATE_OPS` used are those in the graph when `apply_gradients` is
  called (as `slim.learning.create_train_op` does); pass `update_ops` to pick
  a subset, e.g. only the first tower's.
  """

  def __init__(self,
               optimizer,
               *,
               increment_global_step_on_skip=True,
               update_ops=None,
               name="SkipNonFinite"):
    """Creates the wrapper.

    Args:
      optimizer: the `tf.compat.v1.train.Optimizer` to wrap.
      increment_global_step_on_skip: if True (default), `global_step` advances
        on skipped steps too; if False, only on applied steps.
      update_ops: ops whose written variables are rolled back on a skip;
        default: the graph's `UPDATE_OPS` at `apply_gradients` time.
      name: name scope of the decision ops.

    Raises:
      TypeError: if `optimizer` is not a `tf.compat.v1.train.Optimizer`.
    """
    if not isinstance(optimizer, tf1.train.Optimizer):
      raise TypeError("SkipNonFiniteOptimizer wraps a tf.compat.v1.train."
                      "Optimizer, got %r" % (optimizer,))
    super(SkipNonFiniteOptimizer, self).__init__(use_locking=False, name=name)
    self._optimizer = optimizer
    self._increment_global_step_on_skip = increment_global_step_on_skip
    self._update_ops = update_ops
    self._last_result = None

  @property
  def wrapped_optimizer(self):
    return self._optimizer

  def compute_gradients(self, *args, **kwargs):
    """Same as the wrapped optimizer's `compute_gradients`."""
    return self._optimizer.compute_gradients(*args, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Applies the gradients if all are finite; otherwise skips the step.

    Args:
      grads_and_vars: list of (gradient, variable) pairs.
      global_step: optional variable, advanced as the policy says.
      name: optional name for the wrapped optimizer's update ops.

    Returns:
      The step's train op.
    """
    update_ops = self._update_ops
    if update_ops is None:
      update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    grads_and_vars = tuple(grads_and_vars)
    var_list = [v for g, v in grads_and_vars if g is not None]
    if var_list:
      # Slots and non-slot accumulators are created here, in the caller's
      # name scope, as the wrapped optimizer's own apply_gradients would:
      # created inside the cond branch, Adam's beta powers would be named
      # ".../apply/beta1_power" and a checkpoint of an unwrapped run would not
      # restore. (Creating them again inside the branch reuses these.)
      with tf1.init_scope():
        self._optimizer._create_slots(var_list)  # pylint: disable=protected-access

    def apply_fn(checked_grads_and_vars):
      return self._optimizer.apply_gradients(checked_grads_and_vars, name=name)

    result = guard.guarded_apply(
        grads_and_vars,
        apply_fn,
        global_step=global_step,
        increment_global_step_on_skip=self._increment_global_step_on_skip,
        update_ops=update_ops,
        name=self._name)
    tf1.add_to_collection(GUARD_RESULTS, result)
    self._last_result = result
    return result.train_op

  def applied(self):
    """The bool tensor of the last built step: True if it was applied."""
    return self._result().applied

  def guard_result(self):
    """The `guard.GuardResult` of the last `apply_gradients` call."""
    return self._result()

  def _result(self):
    if self._last_result is None:
      raise ValueError("apply_gradients (or minimize) has not been called")
    return self._last_result

  def get_slot(self, var, name):
    return self._optimizer.get_slot(var, name)

  def get_slot_names(self):
    return self._optimizer.get_slot_names()

  def variables(self):
    return self._optimizer.variables()
