"""`SkipNonFiniteOptimizer`: any tf.compat.v1 optimizer, made to skip bad steps.

It wraps an optimizer and keeps its `compute_gradients` / `apply_gradients` /
`minimize` signatures; a step whose gradients hold a NaN or an Inf changes no
variable, slot, accumulator or moving statistic, and is counted instead.
Migration is one line: `opt = SkipNonFiniteOptimizer(opt)`, plus
`train_op = opt.protect(train_op)` when the train op groups ops built after
`apply_gradients` (an `ExponentialMovingAverage`).
"""

from absl import logging
import tensorflow as tf
# Only to keep GUARD_RESULTS out of exported meta graphs (see below).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train import counters as counters_lib
from tf1_safe_train import guard
from tf1_safe_train import loss_scale as loss_scale_lib
from tf1_safe_train import rollback
from tf1_safe_train import step_report
from tf1_safe_train import write_check
from tf1_safe_train import writes

tf1 = tf.compat.v1

# Graph collection of the `guard.GuardResult` of every wrapped step, so hooks
# can find the applied flag and the per-variable flags of legacy train ops
# (and refuse a run of two steps: `write_check`).
GUARD_RESULTS = write_check.GUARD_RESULTS
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
               strict=False,
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
      strict: when `report_hook()` (or `report_fetches(train_op)`) first
        sees a train op that writes variables outside the decision, raise
        instead of warning (see `write_check`).
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
    self._strict = strict
    self._report = None
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
    return self._loss_scale.gradients(
        lambda scaled, **kw: self._optimizer.compute_gradients(
            scaled, *args, **kw), loss, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None,
                      *, tower_grads_and_vars=None):
    """Applies the gradients if all are finite; otherwise skips the step.

    Args:
      grads_and_vars: list of (gradient, variable) pairs.
      global_step: optional variable, advanced as the policy says.
      name: optional name for the wrapped optimizer's update ops.
      tower_grads_and_vars: optional, for the skip report only: one list of
        (gradient, variable) pairs per tower, over the same variables, when
        `grads_and_vars` is their average; the report then names the tower
        and its device. The decision stays on `grads_and_vars` (a tower's
        NaN or Inf reaches the average); the towers' checks only feed the
        report.

    Returns:
      The step's train op.
    """
    grads_and_vars = tuple(grads_and_vars)

    def apply_fn(checked_grads_and_vars):
      return self._optimizer.apply_gradients(checked_grads_and_vars, name=name)

    result = self._build_step(grads_and_vars, global_step, apply_fn,
                              [(self._optimizer, grads_and_vars)])
    towers, devices = None, None
    if tower_grads_and_vars is not None:
      towers, devices = step_report.tower_flags(grads_and_vars,
                                                tower_grads_and_vars)
    self._set_report(result, global_step, towers, devices)
    return result.train_op

  def apply_gradients_per_device(self, grads_and_vars_per_device,
                                 global_step=None, name=None, optimizers=None):
    """One step over several devices' variable copies: one decision, one count.

    For scripts that keep a copy of the variables per device and apply each
    device's (all-reduced) gradients to its own copy: calling
    `apply_gradients` once per device would build one step per device, each
    deciding alone and each counted. Here every device's gradients are
    checked together, one `tf.cond` applies all updates or none, and the
    counters move once. Each device's update is built by its own optimizer
    (the wrapped one by default), which places it on its variables' device.

    Args:
      grads_and_vars_per_device: one list of (gradient, variable) pairs per
        device.
      global_step: optional variable, advanced once per step.
      name: optional name for the wrapped optimizers' update ops.
      optimizers: optional `tf.compat.v1.train.Optimizer` per device (e.g.
        one instance per device, as the script had); default: the wrapped
        optimizer for every device.

    Returns:
      The step's train op.

    Raises:
      ValueError: if `optimizers` does not give one optimizer per device.
    """
    groups = [tuple(g) for g in grads_and_vars_per_device]
    if optimizers is None:
      optimizers = [self._optimizer] * len(groups)
    optimizers = list(optimizers)
    if len(optimizers) != len(groups) or not all(
        isinstance(o, tf1.train.Optimizer) for o in optimizers):
      raise ValueError("apply_gradients_per_device: optimizers must be one "
                       "tf.compat.v1.train.Optimizer per device (%d), got %r"
                       % (len(groups), optimizers))
    sizes = [len(g) for g in groups]

    def apply_fn(checked_grads_and_vars):
      updates, start = [], 0
      for i, (opt, size) in enumerate(zip(optimizers, sizes)):
        pairs = checked_grads_and_vars[start:start + size]
        start += size
        if any(g is not None for g, _ in pairs):
          updates.append(opt.apply_gradients(
              pairs, name=("%s_%d" % (name, i)) if name else None))
      return tf.group(*updates)

    flat = tuple(pair for group in groups for pair in group)
    result = self._build_step(flat, global_step, apply_fn,
                              list(zip(optimizers, groups)))
    checked_sizes = [sum(1 for g, _ in group if g is not None)
                     for group in groups]
    self._set_report(result, global_step,
                     step_report.segment_flags(result.nonfinite_flags,
                                               checked_sizes),
                     [step_report.device_of(group) for group in groups])
    return result.train_op

  def _build_step(self, grads_and_vars, global_step, apply_fn,
                  optimizers_and_pairs):
    """Builds the guarded step; returns its `guard.GuardResult`."""
    if self._last_result is not None:
      # Not an error: a GAN's two steps are built by two calls (and run by
      # two session.run calls); device copies of one step are not.
      logging.warning(
          "SkipNonFiniteOptimizer %r: apply_gradients called again; each "
          "call builds its own step, decided and counted alone. If both run "
          "in one session.run (one per device), use "
          "apply_gradients_per_device.", self._name)
    losses, self._losses = self._losses, []
    update_ops = self._update_ops
    if update_ops is None:
      update_ops = self._default_update_ops(
          [g for g, _ in grads_and_vars if g is not None] + losses)
    for optimizer, pairs in optimizers_and_pairs:
      var_list = [v for g, v in pairs if g is not None]
      if var_list:
        # Slots and non-slot accumulators are created here, in the caller's
        # name scope, as the wrapped optimizer's own apply_gradients would:
        # created inside the cond branch, Adam's beta powers would be named
        # ".../apply/beta1_power" and a checkpoint of an unwrapped run would
        # not restore. (Creating them again inside the branch reuses these.)
        with tf1.init_scope():
          optimizer._create_slots(var_list)  # pylint: disable=protected-access

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
    return result

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

  def _set_report(self, result, global_step, towers, devices):
    """Builds the last step's `step_report.StepReport` (fetched on demand)."""
    with tf1.name_scope(self._name + "_report"):
      step = step_report.step_index(result, global_step,
                                    self._increment_global_step_on_skip)
    self._report = step_report.StepReport(step, result, towers, devices)

  def report_fetches(self, train_op=None):
    """What to fetch with the train op to report a skip (see `describe_skip`).

    In a plain `session.run` loop:

        report = opt.report_fetches(train_op)
        _, values = sess.run([train_op, report], feed_dict)
        line = opt.describe_skip(values)  # None on an applied step

    Args:
      train_op: optional, the train op the loop runs: it is checked now as
        `check_train_op` does (`report_hook()` checks what each run fetches).

    Returns:
      A dict of tensors of the last built step.
    """
    if self._report is None:
      self._result()  # Raises the usual error.
    if train_op is not None:
      self.check_train_op(train_op)
    return self._report.fetches

  def describe_skip(self, values):
    """The skip report line from the fetched `report_fetches()`, or None.

    Like the trainer's: "skipped step 7: non-finite gradients in tower 1
    (/device:GPU:1); variables: conv1/weights" (towers when known:
    `tower_grads_and_vars=` or `apply_gradients_per_device`).
    """
    if self._report is None:
      self._result()
    return self._report.describe(values)

  def report_hook(self):
    """A `SessionRunHook` that logs the report of every skipped step.

    For `MonitoredTrainingSession(hooks=[opt.report_hook()])`. It fetches
    only on runs that run the step, and checks (`check_train_op`) each new
    set of fetched ops before it runs. `reports` holds the lines logged.
    """
    if self._report is None:
      self._result()
    return step_report.StepReportHook(self._report, self.check_train_op)

  def check_train_op(self, train_op):
    """Names what `train_op` writes outside the skip decision.

    Warns once, listing every variable a run of `train_op` writes that a
    skipped step would change (an `ExponentialMovingAverage` without
    `protect()`, update ops grouped after `apply_gradients`, a hand-written
    assign); with `strict=True` raises instead.

    Args:
      train_op: an Operation or Tensor, or a list of them (what a run
        fetches).

    Returns:
      The list of those variables' names (empty if none).

    Raises:
      ValueError: if `strict` and something is written outside the
        decision, or if `train_op` runs more than one guarded step.
    """
    ops = [rollback.as_op(o) for o in tf.nest.flatten(train_op)]
    decisions = [r.applied for r in ops[0].graph.get_collection(
        GUARD_RESULTS)] if ops else []
    handled = [v.op.name for v in self._step_variables]
    return write_check.check(ops, decisions, handled, strict=self._strict)

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
