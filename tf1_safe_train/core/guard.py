"""The apply/skip decision for one training step.

A step is applied only if every gradient is finite (no NaN, +Inf or -Inf)
and no other skip criterion (`criteria.Criterion`, e.g. spikes) fires;
otherwise it is skipped, and no variable of the model, no optimizer slot or
accumulator and no rolled-back moving statistic changes. The decision is one
`tf.cond` whose two branches are built inside the functions passed to it.
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import criteria as criteria_lib
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import reasons as reasons_lib
from tf1_safe_train.core import rollback
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

GuardResult = collections.namedtuple("GuardResult", [
    "train_op", "applied", "nonfinite_flags", "variable_names", "counters",
    "update_flags", "update_variable_names", "spikes", "reasons"
], defaults=(None, None))
GuardResult.__doc__ = """What `guarded_apply` built.

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
  spikes: the step's `spikes.SpikeReport`, or None without spike skips.
  reasons: the step's `reasons.Report` (every criterion's flag, values and
    counters; the label of a skip), or None (a sync replica's view).
"""


def _increment(variable):
  return tf1.assign_add(variable, tf.constant(1, dtype=variable.dtype.base_dtype))


def _done(op_fn):
  """A cond branch that runs `op_fn()`'s op and returns a tensor."""
  def branch():
    with tf1.control_dependencies([op_fn()]):
      return tf.constant(True)
  return branch


def _with_flags(branch_fn, grads, written):
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


def guarded_apply(grads_and_vars,
                  apply_fn,
                  global_step=None,
                  increment_global_step_on_skip=True,
                  update_ops=None,
                  extra_nonfinite=(),
                  branch_ops=(),
                  spikes=None,
                  loss=None,
                  criteria=(),
                  tower_values=None,
                  tower_unit=None,
                  name="skip_nonfinite"):
  """Builds one step that applies `apply_fn` only if every gradient is finite.

  Args:
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
      every step (it counts batches consumed, so `StopAtStepHook` ends the run);
      if False only on applied steps.
    update_ops: ops built during the forward pass that write variables, e.g.
      batch-norm moving statistics from `UPDATE_OPS`. They run before the
      decision, which also checks the values they wrote (a non-finite
      statistic skips the step even behind finite gradients); on a skipped
      step the variables they wrote take back their last applied value (see
      `rollback`).
    extra_nonfinite: bool scalar tensors that also skip the step when True,
      e.g. one per tower from `nonfinite.any_nonfinite(tower_grads)`.
    branch_ops: objects with `on_apply()` and `on_skip()` methods returning
      ops, built inside the apply (after the update) and skip branches, e.g.
      a `loss_scale.DynamicLossScale`. Their `on_skip` runs on a non-finite
      skip only (a spike is no overflow: the loss scale keeps).
    spikes: optional `spikes.SpikeDetector`, a criterion like those of
      `criteria` (kept for callers written before them).
    loss: the step's loss, for the criteria (`criteria.Context`).
    criteria: more `criteria.Criterion`s: a step one of them decides to
      skip is skipped too, by the same decision, and counted under the
      first one that fired (non-finite first, then in this order).
    tower_values: optional dict of per-tower tensors for the criteria
      (`criteria.Context.towers`).
    tower_unit: optional, for a step whose `grads_and_vars` already leave
      out bad towers (the trainer's `tower_unit.TowerUnit`): its `skip`
      (bool scalar) skips the whole step; on an applied step, the update
      ops' writes are kept only if its `keep_updates` (else rolled back,
      and then not checked), `branch_ops` run `on_skip` if it is
      `degraded` (a loss scale halves: a left-out tower overflowed), and
      its `on_apply()` runs; its `variables` are the decision's too.
    name: name scope of the step's ops.

  Returns:
    A `GuardResult`.

  Raises:
    ValueError: if no gradient is given.
  """
  grads_and_vars = tuple(grads_and_vars)
  if all(g is None for g, _ in grads_and_vars):
    raise ValueError("guarded_apply: no gradient for any of %d variables" %
                     len(grads_and_vars))
  update_ops = list(update_ops or [])
  branch_ops = list(branch_ops)
  extra_nonfinite = tuple(extra_nonfinite)
  criteria = criteria_lib.with_nonfinite(
      ([spikes] if spikes is not None else []) + list(criteria))
  counters = counters_lib.skip_counters()
  protected = rollback.Rollback(rollback.written_variables(update_ops))
  with tf1.name_scope(name):
    # The check and the update see the same values: sparse gradients summed.
    grads_and_vars = tuple((nonfinite.sum_duplicates(g), v)
                           for g, v in grads_and_vars)
    checked = [(g, v) for g, v in grads_and_vars if g is not None]
    # Good steps pay for the decision only: fused checks (few kernels
    # however many tensors); the report's per-tensor flags are computed by
    # the skip branch (see _with_flags).
    any_bad = nonfinite.any_nonfinite([g for g, _ in checked])
    for extra in extra_nonfinite:
      any_bad = tf.logical_or(any_bad, extra)
    if tower_unit is not None:
      any_bad = tf.logical_or(any_bad, tower_unit.skip)
    # The decision checks the values the forward-pass updates wrote, and
    # waits for those updates, so the branches see (and save or undo) them.
    # Integer variables (e.g. counters an update op bumps) cannot be NaN.
    # The same values (one concatenation per flat shadow) are what the
    # apply branch saves into the shadows: it reads no variable itself;
    # unless the update also trains one of them (an update op that writes a
    # weight, e.g. a max-norm clip): the shadow must then hold the value
    # after the update, read in the branch.
    trained = set(id(v) for _, v in checked)
    saved_before = not any(id(v) in trained for v in protected.variables)
    checked_writes = [v for v in protected.variables
                      if v.dtype.base_dtype.is_floating]
    updates = [rollback.as_op(u) for u in update_ops]
    written = []
    if protected.variables:
      with tf1.control_dependencies(updates):
        written = protected.values()
        written_bad = nonfinite.any_written_nonfinite(
            [w for w in written if w.dtype.base_dtype.is_floating])
        if tower_unit is not None:  # Rolled back if not kept: harmless.
          written_bad = tf.logical_and(written_bad, tower_unit.keep_updates)
        any_bad = tf.logical_or(any_bad, written_bad)
    decision = reasons_lib.Decision(criteria, criteria_lib.Context(
        checked, loss, any_bad, dict(tower_values or {})),
                                    counters.skipped_steps)
    skip = decision.skip
    # The predicate waits for the update ops (even without a checked write)
    # through an Identity's control inputs, which Grappler forwards when it
    # removes the Identity. Not a LogicalNot's: that of the fused check's
    # LogicalNot is removed as an involution, control inputs and all
    # (TF 2.21; tests/core/protect_test.py testExplicitUpdateOpsWin).
    all_finite = tf.logical_not(skip)
    with tf1.control_dependencies(updates):
      all_finite = tf.identity(all_finite, name="all_finite")

    def _nonfinite_here(flags, update_flags):
      """The verdict from the skip branch's per-tensor flags, without
      capturing `any_bad` (a `Switch` on every step): the same but for
      verdicts the flags do not see (extra ones, the tower unit's)."""
      if extra_nonfinite or tower_unit is not None:
        return any_bad
      return tf.reduce_any(tf.concat([flags, update_flags], 0))

    def _on_skip(bad):
      if not decision.labels or not branch_ops:
        return [b.on_skip() for b in branch_ops]
      # Built in the branch functions, so they run only on a non-finite skip.
      return [tf.cond(bad, lambda: tf.group(*[b.on_skip()
                                              for b in branch_ops]),
                      tf.no_op, name="nonfinite_skip")]

    def _commit():
      commit = lambda: protected.commit(written if saved_before else None)
      if tower_unit is None:
        return commit()
      # Built in the nested branches: tower 0 left out, its writes undone.
      return tf.cond(tower_unit.keep_updates, _done(commit),
                     _done(protected.restore), name="keep_updates")

    def _on_apply():
      if tower_unit is None:
        return [b.on_apply() for b in branch_ops]
      return [tower_unit.on_apply()] + [
          tf.cond(tower_unit.degraded, _done(b.on_skip), _done(b.on_apply),
                  name="degraded") for b in branch_ops]

    def _apply_branch():
      with tf1.name_scope("apply"):
        update = apply_fn(list(grads_and_vars))
        with tf1.control_dependencies([update]):
          steps = [_commit(), _increment(counters.applied_steps),
                   *_on_apply(), *decision.on_apply(),
                   tf1.assign(counters.consecutive_skips,
                              tf.constant(0, dtype=tf.int64))]
          if global_step is not None and not increment_global_step_on_skip:
            steps.append(_increment(global_step))
        with tf1.control_dependencies(steps):
          return tf.identity(tf.constant(True))

    def _skip_branch(flags, update_flags):
      with tf1.name_scope("skip"):
        bad = (_nonfinite_here(flags, update_flags) if decision.labels
               else None)
        steps = [protected.restore(), _increment(counters.skipped_steps),
                 *decision.on_skip(bad), *_on_skip(bad),
                 _increment(counters.consecutive_skips)]
        with tf1.control_dependencies(steps):
          return tf.identity(tf.constant(False))

    touched = ([v for _, v in checked] + protected.variables + list(counters) +
               ([global_step] if global_step is not None else []) +
               decision.variables +
               (tower_unit.variables if tower_unit is not None else []))
    with rollback.control_flow_for(touched):
      applied, flags, update_flags = tf.cond(
          all_finite,
          _with_flags(_apply_branch, len(checked), len(checked_writes)),
          _with_flags(_skip_branch, [g for g, _ in checked], checked_writes),
          name="decide")
    writes.register_decision(applied)
    step_ops = [applied]
    if global_step is not None and increment_global_step_on_skip:
      with tf1.control_dependencies([applied]):
        step_ops.append(_increment(global_step))
    train_op = tf.group(*step_ops, name="train_op")
  return GuardResult(
      train_op=train_op,
      applied=applied,
      nonfinite_flags=flags,
      variable_names=[v.op.name for _, v in checked],
      update_flags=update_flags,
      update_variable_names=[v.op.name for v in checked_writes],
      counters=counters_lib.read_after(counters, train_op),
      spikes=spikes.report(train_op) if spikes is not None else None,
      reasons=decision.report(train_op))
