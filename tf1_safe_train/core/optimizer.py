"""`SkipNonFiniteOptimizer`: any tf.compat.v1 optimizer, made to skip bad steps.

It keeps the wrapped optimizer's `compute_gradients` / `apply_gradients` /
`minimize`; a step whose gradients hold a NaN or an Inf changes no variable,
slot, accumulator or moving statistic, and is counted instead. Migration:
`opt = SkipNonFiniteOptimizer(opt)` (docs/wrapper.md: what else, when).
"""

from absl import logging
import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import criteria as criteria_lib
from tf1_safe_train.core import criterion_registry
from tf1_safe_train.core import guard
from tf1_safe_train.core import guard_parts
from tf1_safe_train.core import keras_route
from tf1_safe_train.core import loss_scale as loss_scale_lib
from tf1_safe_train.core import loss_scale_stacking as stacking
from tf1_safe_train.core import per_device
from tf1_safe_train.core import protecting
from tf1_safe_train.core import raw_gradients
from tf1_safe_train.core import reporting
from tf1_safe_train.core import rollback
from tf1_safe_train.core import run_check
from tf1_safe_train.core import step_report
from tf1_safe_train.core import sync_stacking
from tf1_safe_train.core import wrapper_replay
from tf1_safe_train.core import write_check

tf1 = tf.compat.v1

# Every step's `guard.GuardResult`, for hooks and `write_check`.
GUARD_RESULTS = write_check.GUARD_RESULTS


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
  `update_ops` is given: the entries the step runs anyway, and the writes
  its forward pass makes in place, in no collection (batch norm with
  `updates_collections=None`; `rollback.update_ops_run_by`); wrapping never
  makes a step run an update op the script did not run. An update op whose
  writes cannot be analysed (a loop, a function call, an unknown write op)
  raises a ValueError naming it and the variable.

  Its parts, each made here and owned: the last built step and its report
  (`reporting.LastStep`), `protect` and `variables` (`protecting`), the
  replay and report hook (`wrapper_replay`), `apply_gradients_per_device`
  (`per_device`), the stacks with `SyncReplicasOptimizer` (`sync_stacking`)
  and with loss-scale skips (`loss_scale_stacking`).
  """

  def __init__(self,
               optimizer,
               *,
               increment_global_step_on_skip=True,
               update_ops=None,
               loss_scale=None,
               strict=False,
               criteria=(),
               check_runs=True,
               tower_unit=None,
               name="SkipNonFinite",
               **criterion_keywords):
    """Creates the wrapper.

    Args:
      optimizer: the `tf.compat.v1.train.Optimizer` to wrap.
      increment_global_step_on_skip: if True (default), `global_step` advances
        on skipped steps too; if False, only on applied steps.
      update_ops: ops whose written variables are rolled back on a skip;
        default: the `UPDATE_OPS` entries and in-place writes the step
        runs anyway (see the class docstring).
      loss_scale: None; "dynamic" for a `loss_scale.DynamicLossScale` with
        its defaults (initial scale 2**15, doubled after 2000 applied steps
        in a row, halved by every skip); or a `DynamicLossScale`. With a loss
        scale, `compute_gradients` differentiates the scaled loss and returns
        the gradients divided by the scale (each in its variable's dtype,
        divided in float32), and the scale's update shares the decision.
      strict: when the first run of a step (or `check_train_op`) finds
        what a skip cannot undo or count once (writes outside the decision,
        several guarded steps in one run, global_step advanced twice),
        raise instead of warning (see `run_check`).
      criteria: more skip criteria (`criteria.Criterion` objects): a step
        one of them decides to skip is skipped, labelled and counted with
        its reason.
      check_runs: if True (default), the first `session.run` (or callable)
        of each distinct set of fetches that executes a step of this
        wrapper is checked, whoever runs it (`run_check`); later runs of
        the same fetches pay one dict lookup. False: no such check.
      tower_unit: the trainer's --skip_unit=tower (`guard_parts.TowerUnit`).
      name: name scope of the decision ops.
      **criterion_keywords: the library's criteria (`criterion_registry`;
        None = off): `skip_spikes=` a `SpikeConfig` or its sigma (a spike in
        the gradient norm or loss), `skip_grad_norm_above=` a norm,
        `skip_tower_outliers=` a `TowerOutlierConfig` or its K (a tower
        disagreeing with the others; needs `tower_grads_and_vars=`).

    Raises:
      TypeError: if `optimizer` is not a `tf.compat.v1.train.Optimizer`,
        or for an unknown keyword.
      ValueError: for an unknown `loss_scale`, a bad criterion or keyword.
    """
    if not isinstance(optimizer, tf1.train.Optimizer):
      # (A Keras optimizer too: its updates are not a tf.compat.v1 step.)
      raise TypeError("SkipNonFiniteOptimizer wraps a tf.compat.v1.train."
                      "Optimizer (not a Keras optimizer), got %r"
                      % (optimizer,))
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
    self._strict = strict
    self._check_runs = check_runs
    self._tower_unit = ([guard_parts.TowerUnit(tower_unit)] if tower_unit
                        else [])
    # Built with each step (its state then made: `variables()` has it).
    self._keyword_criteria = criterion_registry.from_keywords(
        criterion_keywords)
    self._criteria = criteria_lib.with_nonfinite(criteria)[1:]  # Checked.
    # Losses given to compute_gradients since the last apply_gradients.
    self._losses = []
    # {id(variable): (variable, gradient)} compute_gradients returned since
    # then, for the skip report (`raw_gradients`); (None, None) if twice.
    self._computed = {}
    self._last_step = reporting.LastStep(name, increment_global_step_on_skip)
    self._protection = protecting.Protection(optimizer, loss_scale,
                                             self._last_step)
    self._replay = wrapper_replay.Replay(name, self._last_step,
                                         self._loss_scale)
    self._per_device = per_device.PerDeviceSteps(optimizer, self._build_step,
                                                 self._last_step)
    self._sync = sync_stacking.SyncStacking(
        optimizer, self._last_step, self._build_step, self.protect,
        increment_global_step_on_skip=increment_global_step_on_skip,
        update_ops=update_ops, strict=strict)
    self._loss_scale_stacking = stacking.LossScaleStacking(
        self, optimizer, loss_scale, strict)

  wrapped_optimizer = property(lambda self: self._optimizer)

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
      pairs = self._optimizer.compute_gradients(loss, *args, **kwargs)
    else:
      pairs = self._loss_scale.gradients(
          lambda scaled, **kw: self._optimizer.compute_gradients(
              scaled, *args, **kw), loss, **kwargs)
    for g, v in pairs:
      self._computed[id(v)] = ((None, None) if id(v) in self._computed
                               else (v, g))
    return pairs

  def apply_gradients(self, grads_and_vars, global_step=None, name=None,
                      **kwargs):
    """`apply_gradients_with_result`'s train op (the Optimizer API)."""
    return self.apply_gradients_with_result(grads_and_vars, global_step,
                                            name, **kwargs).train_op

  def apply_gradients_with_result(self, grads_and_vars, global_step=None,
                                  name=None, *, tower_grads_and_vars=None,
                                  loss=None, tower_values=None):
    """Applies the gradients if all are finite; otherwise skips the step.

    Args:
      grads_and_vars: list of (gradient, variable) pairs.
      global_step: optional variable, advanced as the policy says.
      name: optional name for the wrapped optimizer's update ops.
      tower_grads_and_vars: optional: one list of (gradient, variable)
        pairs per tower, over the same variables, when `grads_and_vars` is
        their average: the report names the tower and its device (a
        tower's NaN or Inf reaches the average, decided on), and
        `skip_tower_outliers=` compares the towers' norms (it skips the
        step on an outlier: the average it applies cannot leave one out).
      loss: optional, the step's loss for the criteria (default: the mean
        of the losses given to `compute_gradients` since the last step).
      tower_values: optional dict of per-tower tensors (first axis the
        tower) for the criteria (`criteria.Context.towers`).

    Returns:
      The step's `guard.GuardResult` (`train_op` runs the step).
    """
    grads_and_vars = tuple(grads_and_vars)
    losses, self._losses = self._losses, []
    stacked, self._losses = self._sync.step(grads_and_vars, global_step,
                                            name, losses)
    if stacked is not None:
      return stacked  # SyncReplicasOptimizer's: `sync_stacking`.
    # Before the change (e.g. clipping) the script made after computing.
    raw = raw_gradients.before_changes(
        [(g, v) for g, v in grads_and_vars if g is not None], self._computed)

    def apply_fn(checked_grads_and_vars):
      return self._optimizer.apply_gradients(checked_grads_and_vars, name=name)

    if tower_grads_and_vars is not None:
      tower_grads_and_vars = [list(t) for t in tower_grads_and_vars]
      tower_values = dict(step_report.tower_values(grads_and_vars,
                                                   tower_grads_and_vars),
                          **(tower_values or {}))
    result = self._build_step(grads_and_vars, global_step, apply_fn,
                              [(self._optimizer, grads_and_vars)], loss,
                              tower_values)
    towers, devices = None, None
    if tower_grads_and_vars is not None:
      towers, devices = step_report.tower_flags(grads_and_vars,
                                                tower_grads_and_vars)
    self._last_step.set_report(result, global_step, towers, devices, raw)
    return result

  def _build_step(self, grads_and_vars, global_step, apply_fn,
                  optimizers_and_pairs, loss=None, tower_values=None):
    """Builds the guarded step; returns its `guard.GuardResult`."""
    self._loss_scale_stacking.check_step_place()
    last = self._last_step
    if last.result is not None:
      # Not an error: a GAN's two steps are built by two calls (and run by
      # two session.run calls); device copies of one step are not.
      logging.warning(
          "SkipNonFiniteOptimizer %r: apply_gradients called again; each "
          "call builds its own step, decided and counted alone. If both run "
          "in one session.run (one per device), use "
          "apply_gradients_per_device.", self._name)
    losses, self._losses = self._losses, []
    self._computed = {}
    self._replay.note_step(losses, grads_and_vars)
    # No name scope of its own: the decision's would be "SkipNonFinite_1".
    last.roots = rollback.step_roots(
        [g for g, _ in grads_and_vars if g is not None] + losses,
        self._name + "_control_dependencies")
    update_ops = self._update_ops
    if update_ops is None:
      update_ops = rollback.update_ops_run_by(
          last.roots, [global_step] if global_step is not None else [])
      # Keras 2 (`compile(optimizer=...)`) runs its model's updates next to
      # the step, and tells the optimizer nothing of them.
      update_ops += keras_route.compiling_model_updates(update_ops)
    known = protecting.graph_variables()
    keras_route.expose_learning_rate(self, self._optimizer)  # Keras' `lr`.
    for optimizer, pairs in optimizers_and_pairs:
      var_list = [v for g, v in pairs if g is not None]
      if var_list:
        # Slots and accumulators are made here, in the caller's name scope,
        # as the wrapped optimizer would: made in the cond's branch, Adam's
        # beta powers would be ".../apply/beta1_power" and a checkpoint of
        # an unwrapped run would not restore. (The branch reuses these.)
        with tf1.init_scope():
          optimizer._create_slots(var_list)  # pylint: disable=protected-access
    mean_loss = lambda: tf.add_n(losses) / float(len(losses))  # If read.
    result = guard.decide(guard.Step(
        grads_and_vars, apply_fn, global_step,
        self._increment_global_step_on_skip, update_ops,
        loss if loss is not None or not losses else mean_loss, tower_values,
        self._name), self._step_criteria())
    tf1.add_to_collection(GUARD_RESULTS, result)
    self._protection.note_own_variables(known)
    last.result = result
    last.variables = (
        rollback.written_variables(update_ops) +
        list(counters_lib.skip_counters()) +
        (self._loss_scale.all_variables if self._loss_scale else []) +
        result.reasons.variables +
        ([global_step] if global_step is not None else []))
    last.run_step = write_check.Step(
        result.applied, result.train_op, global_step,
        frozenset(v.op.name for v in last.variables +
                  keras_route.compiling_model_metric_variables()),
        self._strict)
    if self._check_runs:
      run_check.watch(last.run_step, self)
    return result

  def _step_criteria(self):
    """The criteria of a step: keywords', the caller's, the parts."""
    overflow = self._loss_scale_stacking.branch_ops()
    return ([spec.build(config) for spec, config in self._keyword_criteria]
            + self._criteria + [guard_parts.OnOverflow(b) for b in overflow]
            + self._tower_unit)

  def get_slot(self, var, name):
    return self._optimizer.get_slot(var, name)

  def get_slot_names(self):
    return self._optimizer.get_slot_names()

  # The parts' API, the wrapper's (README.md, docs/wrapper.md).

  def protect(self, op, name="protect"):
    self._sync.check_protect()  # Refused inside SyncReplicasOptimizer.
    return self._protection.protect(op, name)

  def variables(self):
    return self._protection.variables()

  def applied(self):
    """The bool tensor of the last built step: True if it was applied."""
    return self._last_step.get().applied

  def guard_result(self):
    """The `guard.GuardResult` of the last `apply_gradients` call."""
    return self._last_step.get()

  def report_fetches(self, train_op=None):
    return self._last_step.report_fetches(train_op)

  def describe_skip(self, values):
    return self._last_step.describe_skip(values)

  def check_train_op(self, train_op):
    return self._last_step.check_train_op(train_op)

  def build_replay(self, inputs=None):
    return self._replay.build_replay(inputs)

  def replay(self, session, feed_dict):
    return self._replay.replay(session, feed_dict)

  def report_hook(self, skip_log_path=None, worker=0, replay=False,
                  max_replays=10, batch_size=None):
    return self._replay.report_hook(skip_log_path, worker, replay,
                                    max_replays, batch_size)

  def apply_gradients_per_device(self, grads_and_vars_per_device,
                                 global_step=None, name=None, optimizers=None):
    return self._per_device.apply_gradients_per_device(
        grads_and_vars_per_device, global_step, name, optimizers)

  def __getattr__(self, name):
    # Only for names the instance lacks: `SyncReplicasOptimizer`'s session
    # API, which scripts call on the optimizer they built (`mnist_replica.
    # py`): the wrapper outside answers them for it. Never before `_sync`.
    sync = self.__dict__.get("_sync")
    try:
      if sync is None:
        raise AttributeError(name)
      return sync.session_api(name)
    except AttributeError:
      raise AttributeError("%r object has no attribute %r"
                           % (type(self).__name__, name)) from None


for _part, _names in (
    (protecting.Protection, ("protect", "variables")),
    (reporting.LastStep, ("report_fetches", "describe_skip",
                          "check_train_op")),
    (wrapper_replay.Replay, ("build_replay", "replay", "report_hook")),
    (per_device.PerDeviceSteps, ("apply_gradients_per_device",))):
  for _name in _names:  # One docstring, the part's, for `help(opt)`.
    getattr(SkipNonFiniteOptimizer, _name).__doc__ = getattr(
        _part, _name).__doc__
del _part, _names, _name
