"""The apply/skip decision for one training step.

A step is applied only if every gradient is finite (no NaN, +Inf or -Inf)
and no other skip criterion (`criteria.Criterion`, e.g. spikes) fires;
otherwise it is skipped, and no variable of the model, no optimizer slot or
accumulator and no rolled-back moving statistic changes. The decision is one
`tf.cond` whose two branches are built inside the functions passed to it.
`decide(Step(...), criteria)` builds it; every reason to skip and every
part of the decision that reacts to one (a loss scale, the tower unit:
`guard_parts`) is one of its criteria, decided from one `Context` per step.
"""

import collections
import weakref

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import criteria as criteria_lib
from tf1_safe_train.core import guard_parts
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import reasons as reasons_lib
from tf1_safe_train.core import rollback
from tf1_safe_train.core import verdict as verdict_lib
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

_FIELDS = ["train_op", "applied", "nonfinite_flags", "variable_names",
           "counters", "update_flags", "update_variable_names", "reasons"]
# The spike criterion's deprecated `SpikeReport`s, built once per step.
_SPIKE_REPORTS = weakref.WeakKeyDictionary()


class GuardResult(collections.namedtuple("GuardResult", _FIELDS,
                                         defaults=(None,))):
  """What `decide` built.

  Attributes:
    train_op: the step's train op (decision, update or skip, counters,
      global_step).
    applied: bool scalar tensor, True if this step's update was applied.
    nonfinite_flags: bool vector tensor, one flag per checked gradient (True =
      the gradient held a NaN or an Inf), aligned with `variable_names`. An
      output of the decision, like `applied` (fetch it with the train op):
      computed on a skipped step only, all False on an applied one.
    variable_names: Python list of the checked variables' names.
    counters: `SkipCounters` of int64 tensors read after the step.
    update_flags: bool vector tensor, one flag per floating-point variable
      written by the update ops (e.g. a batch-norm moving statistic), True if
      its value after them holds a NaN or an Inf; aligned with
      `update_variable_names`. An output of the decision, like
      `nonfinite_flags`.
    update_variable_names: Python list of those variables' names.
    reasons: the step's `reasons.Report` (every criterion's flag, values and
      counters; the label of a skip), or None (a sync replica's view).
  """
  __slots__ = ()

  @property
  def spikes(self):
    """Deprecated (`reasons` says it of every criterion): the spike
    detector's `spikes.SpikeReport`, or None without one."""
    detector = next((c for c in (self.reasons.criteria if self.reasons
                                 else []) if hasattr(c, "report")), None)
    if detector is None:
      return None
    if self.reasons not in _SPIKE_REPORTS:
      _SPIKE_REPORTS[self.reasons] = detector.report(self.train_op)
    return _SPIKE_REPORTS[self.reasons]


Step = collections.namedtuple("Step", [
    "grads_and_vars", "apply_fn", "global_step",
    "increment_global_step_on_skip", "update_ops", "loss", "tower_values",
    "name"], defaults=(None, True, None, None, None, "skip_nonfinite"))
Step.__doc__ = """What one guarded step applies (`decide`).

Attributes:
  grads_and_vars: list of (gradient, variable) pairs; `None` gradients are
    ignored, `IndexedSlices` are checked through their values once the
    values of repeated indices are summed (`sum_duplicates`), and are
    handed to `apply_fn` so summed.
  apply_fn: `apply_fn(grads_and_vars) -> Operation` builds the update (the
    optimizer's `apply_gradients` without `global_step`, plus anything that
    must happen only on an applied step, e.g. an EMA of the weights). It is
    called inside the apply branch of the `tf.cond`, so nothing it builds
    runs on a skipped step.
  global_step: optional int variable advanced by this step.
  increment_global_step_on_skip: if True (default) `global_step` advances on
    every step (it counts batches consumed, so `StopAtStepHook` ends the
    run); if False only on applied steps.
  update_ops: ops built during the forward pass that write variables, e.g.
    batch-norm moving statistics from `UPDATE_OPS`. They run before the
    decision, which also checks the values they wrote (a non-finite
    statistic skips the step even behind finite gradients); on a skipped
    step the variables they wrote take back their last applied value (see
    `rollback`).
  loss: the step's loss for the criteria (`criteria.Context.loss`), or a
    function building it (called only if a criterion reads it).
  tower_values: optional dict of per-tower values for the criteria
    (`criteria.Context.towers`: tensors, functions building them, or
    Python data such as the towers' devices).
  name: name scope of the step's ops.
"""


def _increment(variable):
  return tf1.assign_add(variable, tf.constant(1, dtype=variable.dtype.base_dtype))


class _Branches(object):
  """The cond's two branches of one step."""

  def __init__(self, step, verdict, decision, parts, counters):
    self.step, self.verdict, self.decision = step, verdict, decision
    self.parts, self.counters = parts, counters

  def apply(self, checked_pairs):
    step, counters = self.step, self.counters
    with tf1.name_scope("apply"):
      update = step.apply_fn(list(checked_pairs))
      with tf1.control_dependencies([update]):
        ops = [self.verdict.commit(), _increment(counters.applied_steps)]
        for part in self.parts:
          ops += tf.nest.flatten(part.on_apply(self.decision.context))
        ops += [*self.decision.on_apply(),
                tf1.assign(counters.consecutive_skips,
                           tf.constant(0, dtype=tf.int64))]
        if (step.global_step is not None and
            not step.increment_global_step_on_skip):
          ops.append(_increment(step.global_step))
      with tf1.control_dependencies(ops):
        return tf.identity(tf.constant(True))

  def skip(self, flags, update_flags):
    decision, context = self.decision, self.decision.context
    with tf1.name_scope("skip"):
      bad = (self.verdict.here(flags, update_flags) if decision.labels
             else None)
      context.skip_nonfinite = bad
      ops = [self.verdict.protected.restore(),
             _increment(self.counters.skipped_steps),
             *decision.on_skip(bad)]
      for part in self.parts:
        ops += tf.nest.flatten(part.on_skip(context))
      ops.append(_increment(self.counters.consecutive_skips))
      with tf1.control_dependencies(ops):
        return tf.identity(tf.constant(False))


def _checked(grads_and_vars):
  """The step's pairs, sparse gradients summed, and those checked."""
  # The check and the update see the same values: sparse gradients summed.
  pairs = tuple((nonfinite.sum_duplicates(g), v) for g, v in grads_and_vars)
  return pairs, [(g, v) for g, v in pairs if g is not None]


def _predicate(any_skip, updates):
  """not(any_skip), waiting for the update ops.

  The predicate waits for the update ops (even without a checked write)
  through an Identity's control inputs, which Grappler forwards when it
  removes the Identity. Not a LogicalNot's: that of the fused check's
  LogicalNot is removed as an involution, control inputs and all
  (TF 2.21; tests/core/protect_test.py testExplicitUpdateOpsWin).
  """
  all_finite = tf.logical_not(any_skip)
  with tf1.control_dependencies(updates):
    return tf.identity(all_finite, name="all_finite")


def decide(step, criteria=()):
  """Builds one step that applies `step.apply_fn` only if every gradient is
  finite and no criterion decides to skip it.

  Args:
    step: a `Step`.
    criteria: `criteria.Criterion`s: a step one of them decides to skip is
      skipped too, by the same decision, and counted under the first one
      that fired (non-finite first, then in this order); and the decision's
      parts (`guard_parts.Part`s: criteria without a reason).

  Returns:
    A `GuardResult`.

  Raises:
    ValueError: if no gradient is given, or for a bad criterion.
  """
  step = step._replace(grads_and_vars=tuple(step.grads_and_vars))
  if all(g is None for g, _ in step.grads_and_vars):
    raise ValueError("guarded_apply: no gradient for any of %d variables" %
                     len(step.grads_and_vars))
  # (A criterion with no reason that is no part is refused, as any bad one.)
  parts = [c for c in criteria if isinstance(c, guard_parts.Part)]
  reasons = criteria_lib.with_nonfinite(
      [c for c in criteria if not isinstance(c, guard_parts.Part)])
  counters = counters_lib.skip_counters()
  update_ops = list(step.update_ops or [])
  protected = rollback.Rollback(rollback.written_variables(update_ops))
  with tf1.name_scope(step.name):
    pairs, checked = _checked(step.grads_and_vars)
    verdict = verdict_lib.Verdict(checked, protected, update_ops, parts)
    context = criteria_lib.Context(checked, step.loss, verdict.any_bad,
                                   step.tower_values)
    for part in parts:
      part.decide(context)
    decision = reasons_lib.Decision(reasons, context, counters.skipped_steps)
    all_finite = _predicate(decision.skip, verdict.updates)
    branches = _Branches(step, verdict, decision, parts, counters)
    touched = ([v for _, v in checked] + verdict.protected.variables +
               list(counters) + decision.variables +
               [v for p in parts for v in p.variables] +
               ([step.global_step] if step.global_step is not None else []))
    with rollback.control_flow_for(touched):
      applied, flags, update_flags = tf.cond(
          all_finite,
          verdict_lib.with_flags(lambda: branches.apply(pairs),
                                 len(checked), len(verdict.checked_writes)),
          verdict_lib.with_flags(branches.skip, [g for g, _ in checked],
                                 verdict.checked_writes),
          name="decide")
    writes.register_decision(applied)
    step_ops = [applied]
    if step.global_step is not None and step.increment_global_step_on_skip:
      with tf1.control_dependencies([applied]):
        step_ops.append(_increment(step.global_step))
    train_op = tf.group(*step_ops, name="train_op")
  return GuardResult(
      train_op=train_op, applied=applied, nonfinite_flags=flags,
      variable_names=[v.op.name for _, v in checked],
      update_flags=update_flags,
      update_variable_names=[v.op.name for v in verdict.checked_writes],
      counters=counters_lib.read_after(counters, train_op),
      reasons=decision.report(train_op))


def guarded_apply(grads_and_vars, apply_fn, global_step=None,
                  increment_global_step_on_skip=True, update_ops=None,
                  extra_nonfinite=(), branch_ops=(), spikes=None, loss=None,
                  criteria=(), tower_values=None, tower_unit=None,
                  name="skip_nonfinite"):
  """Deprecated: `decide(Step(...), criteria)`, which this calls.

  `extra_nonfinite` (bool scalars) is `guard_parts.NonFiniteToo`,
  `branch_ops` (objects with `on_apply()` / `on_skip()`, e.g. a loss scale)
  `guard_parts.OnOverflow` each, `spikes` (a `SpikeDetector`) a criterion
  before `criteria`, `tower_unit` `guard_parts.TowerUnit`.
  """
  parts = ([guard_parts.NonFiniteToo(extra_nonfinite)] +
           [guard_parts.OnOverflow(b) for b in branch_ops] +
           ([guard_parts.TowerUnit(tower_unit)] if tower_unit is not None
            else []))
  grads_and_vars = tuple(grads_and_vars)
  return decide(Step(grads_and_vars, apply_fn, global_step,
                     increment_global_step_on_skip, update_ops, loss,
                     tower_values, name),
                ([spikes] if spikes is not None else []) + list(criteria) +
                parts)
