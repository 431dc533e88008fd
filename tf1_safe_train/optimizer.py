"""`SkipNonFiniteOptimizer`: any tf.compat.v1 optimizer, made to skip bad steps.

It wraps an optimizer and keeps its `compute_gradients` / `apply_gradients` /
`minimize` signatures; a step whose gradients hold a NaN or an Inf changes no
variable, slot, accumulator or moving statistic, and is counted instead.
Migration is one line: `opt = SkipNonFiniteOptimizer(opt)`, plus
`train_op = opt.protect(train_op)` when the train op groups ops built after
`apply_gradients` (an `ExponentialMovingAverage`).
"""

import tensorflow as tf
# Only to keep GUARD_RESULTS out of exported meta graphs (see below).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train import counters as counters_lib
from tf1_safe_train import guard
from tf1_safe_train import loss_scale as loss_scale_lib
from tf1_safe_train import rollback
from tf1_safe_train import writes

tf1 = tf.compat.v1

# Graph collection of the `guard.GuardResult` of every wrapped step, so hooks
# can find the applied flag and the per-variable flags of legacy train ops.
GUARD_RESULTS = "tf1_safe_train_guard_results"
# They are Python tuples, which a meta-graph export (every checkpoint of a
# MonitoredTrainingSession) cannot serialize and warns about: export nothing.
tf_ops.register_proto_function(
    GUARD_RESULTS, to_proto=lambda result, export_scope=None: None)


class SkipNonFiniteOptimizer(tf1.train.Optimizer):
  """Wraps a `tf.compat.v1.train.Optimizer`; skips non-finite steps.

  What is protected on a skipped step: every variable the wrapped optimizer
  would update, its slots (momentum, Adam's m and v, RMSProp's ms/mom, ...)
  and non-slot accumulators (Adam's beta powers, ...), because the whole
  `apply_gradients` of the wrapped optimizer is built inside the apply branch
  of one `tf.cond`; and every variable written by the step's entries of the
  graph's `UPDATE_OPS` collection (batch-norm moving statistics, see below),
  which run before the decision and are restored from a shadow copy when the
  step is skipped.

  Ops the caller builds after `apply_gradients` and runs in the same step (an
  `ExponentialMovingAverage` grouped into the train op, a hand-written
  assign) are outside the decision and would still write on a skipped step:
  pass them, or the whole train op, through `protect`, which rolls back the
  variables they wrote (EMA shadows) the same way. Legacy multi-tower code:

      opt = SkipNonFiniteOptimizer(tf.compat.v1.train.MomentumOptimizer(...))
      ...
      with tf.control_dependencies(update_ops):  # first tower's UPDATE_OPS
        apply_gradient_op = opt.apply_gradients(grads, global_step)
      variables_averages_op = ema.apply(tf.compat.v1.trainable_variables())
      train_op = opt.protect(tf.group(apply_gradient_op,
                                      variables_averages_op))

  Which `UPDATE_OPS` are rolled back (and run before the decision), unless
  `update_ops` is given: the entries the step runs anyway, i.e. those among
  the ancestors of the caller's `tf.control_dependencies` at
  `apply_gradients` time (the legacy idiom: the first tower's statistics
  only), of the gradients, or of the losses given to `compute_gradients`
  (tf-slim's `create_train_op` puts its update ops in a barrier the loss
  depends on); otherwise none. Wrapping never makes a step run an update op
  the script did not run. Update ops grouped into the train op after
  `apply_gradients` are not seen here: pass the train op through `protect`
  (the warning at session start names variables written outside the
  decision). Variables written in conds (a batch norm whose `training` is a
  tensor) are found too; an update op whose writes cannot be analysed (a
  loop, a function call, an unknown write op) raises a ValueError naming it
  and the variable.
  """

  def __init__(self,
               optimizer,
               *,
               increment_global_step_on_skip=True,
               update_ops=None,
               loss_scale=None,
               name="SkipNonFinite"):
    """Creates the wrapper.

    Args:
      optimizer: the `tf.compat.v1.train.Optimizer` to wrap.
      increment_global_step_on_skip: if True (default), `global_step` advances
        on skipped steps too; if False, only on applied steps.
      update_ops: ops whose written variables are rolled back on a skip;
        default: the `UPDATE_OPS` entries the step runs anyway (ancestors of
        the caller's control dependencies at `apply_gradients` time, of the
        gradients or of the losses), otherwise none (see the class
        docstring).
      loss_scale: None; "dynamic" for a `loss_scale.DynamicLossScale` with
        its defaults (initial scale 2**15, doubled after 2000 applied steps
        in a row, halved by every skip); or a `DynamicLossScale`. With a loss
        scale, `compute_gradients` differentiates the scaled loss and returns
        the gradients divided by the scale (each in its variable's dtype,
        divided in float32), and the scale's update shares
        this wrapper's apply/skip decision.
      name: name scope of the decision ops.

    Raises:
      TypeError: if `optimizer` is not a `tf.compat.v1.train.Optimizer`.
      ValueError: for an unknown `loss_scale`.
    """
    if not isinstance(optimizer, tf1.train.Optimizer):
      raise TypeError("SkipNonFiniteOptimizer wraps a tf.compat.v1.train."
                      "Optimizer, got %r" % (optimizer,))
    super(SkipNonFiniteOptimizer, self).__init__(use_locking=False, name=name)
    self._optimizer = optimizer
    self._increment_global_step_on_skip = increment_global_step_on_skip
    self._update_ops = update_ops
    if loss_scale == "dynamic":
      loss_scale = loss_scale_lib.DynamicLossScale()
    elif not (loss_scale is None or
              isinstance(loss_scale, loss_scale_lib.DynamicLossScale)):
      raise ValueError("loss_scale must be None, 'dynamic' or a "
                       "DynamicLossScale, got %r" % (loss_scale,))
    self._loss_scale = loss_scale
    self._last_result = None
    # Losses given to compute_gradients since the last apply_gradients.
    self._losses = []
    # Variables the last step already handles (global_step, counters, rolled
    # back update-op targets): `protect` leaves them alone.
    self._step_variables = []

  @property
  def wrapped_optimizer(self):
    return self._optimizer

  @property
  def loss_scale(self):
    """The `loss_scale.DynamicLossScale`, or None."""
    return self._loss_scale

  def compute_gradients(self, loss, *args, **kwargs):
    """The wrapped optimizer's `compute_gradients`, loss-scaled if enabled."""
    if isinstance(loss, tf.Tensor):
      # Update ops the loss depends on run with every step: apply_gradients
      # rolls them back (tf-slim's barrier on the loss; see the class doc).
      self._losses.append(loss)
    if self._loss_scale is None:
      return self._optimizer.compute_gradients(loss, *args, **kwargs)
    scale = self._loss_scale.scale()
    scaled = loss * tf.cast(scale, loss.dtype)
    grads_and_vars = self._optimizer.compute_gradients(scaled, *args, **kwargs)
    return self._loss_scale.unscale(grads_and_vars, scale)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Applies the gradients if all are finite; otherwise skips the step.

    Args:
      grads_and_vars: list of (gradient, variable) pairs.
      global_step: optional variable, advanced as the policy says.
      name: optional name for the wrapped optimizer's update ops.

    Returns:
      The step's train op.
    """
    grads_and_vars = tuple(grads_and_vars)
    losses, self._losses = self._losses, []
    update_ops = self._update_ops
    if update_ops is None:
      update_ops = self._default_update_ops(
          [g for g, _ in grads_and_vars if g is not None] + losses)
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
        branch_ops=[self._loss_scale] if self._loss_scale else [],
        name=self._name)
    tf1.add_to_collection(GUARD_RESULTS, result)
    self._last_result = result
    self._step_variables = (
        rollback.written_variables(update_ops) +
        list(counters_lib.skip_counters()) +
        (list(self._loss_scale.variables) if self._loss_scale else []) +
        ([global_step] if global_step is not None else []))
    return result.train_op

  def _default_update_ops(self, tensors):
    """The `UPDATE_OPS` entries this step runs anyway (class docstring).

    They are the entries among the ancestors of the caller's control
    dependencies, of the gradients and of the losses given to
    `compute_gradients`: one backward walk over the graph, each op once.

    Args:
      tensors: the gradients (Tensors or IndexedSlices) and losses.

    Returns:
      A list of `UPDATE_OPS` entries, in the collection's order.
    """
    everything = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    if not everything:
      return []
    # A NoOp built here carries the caller's `control_dependencies` as its
    # control inputs: the public way to read them. (Not in a name scope of
    # its own, which would rename the decision's to "SkipNonFinite_1".)
    probe = tf.no_op(name=self._name + "_control_dependencies")
    entries = {rollback.as_op(u) for u in everything}
    stack = list(probe.control_inputs)
    for tensor in tf.nest.flatten(tensors, expand_composites=True):
      stack.append(tensor.op)
    found, seen = set(), set()
    while stack and len(found) < len(entries):
      op = stack.pop()
      if op in seen:
        continue
      seen.add(op)
      if op in entries:
        found.add(op)
      stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return [u for u in everything if rollback.as_op(u) in found]

  def protect(self, op, name="protect"):
    """Returns `op`, made to change nothing on a skipped step.

    `op` (or a list of ops) runs as before; once the last built step is
    decided, every variable it wrote takes back its value from before the
    step if the step was skipped (a shadow copy, taken on applied steps, as
    for moving statistics: see `rollback`). So an `ExponentialMovingAverage`
    built after `apply_gradients` and grouped into the train op leaves its
    shadows bit-identical on a skipped step. `op` may be the whole train op:
    the variables the step itself handles (`global_step`, the skip counters,
    the rolled-back `UPDATE_OPS` targets, and everything the wrapped
    optimizer updates inside the decision) are left to it.

    The written variables are found as for `UPDATE_OPS` (assign and scatter
    ops, followed through `tf.group`, `tf.identity` and reads, never into the
    forward pass); each costs one shadow variable (saved in checkpoints) and
    one copy per step.

    Args:
      op: an Operation or Tensor (or a list of them) built after
        `apply_gradients`, e.g. `ema.apply(...)` or
        `tf.group(apply_gradient_op, variables_averages_op)`.
      name: name scope of the added ops.

    Returns:
      An Operation that runs `op` and then keeps or undoes what it wrote.

    Raises:
      ValueError: if `apply_gradients` has not been called, or `op` writes
        something that is not a global or local variable.
    """
    result = self._result()
    ops = [rollback.as_op(o) for o in tf.nest.flatten(op)]
    handled = {v.op.name for v in self._step_variables}
    protected = rollback.Rollback([
        v for v in rollback.written_variables(ops)
        if v.op.name not in handled])
    with tf1.name_scope(name):
      if not protected.variables:
        return tf.group(*ops, name="unchanged")
      # Decide only once `op` has written and the step has been decided.
      with tf1.control_dependencies(ops):
        applied = tf.identity(result.applied, name="applied")

      def _keep():
        with tf1.control_dependencies([protected.commit()]):
          return tf.identity(tf.constant(True))

      def _undo():
        with tf1.control_dependencies([protected.restore()]):
          return tf.identity(tf.constant(False))

      # pylint: disable=protected-access
      with guard._control_flow_for(protected.variables):
        decided = tf.cond(applied, _keep, _undo, name="keep_or_undo")
      writes.register_decision(decided)
      return tf.group(*(ops + [decided]), name="protected")

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
