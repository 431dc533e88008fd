"""The apply/skip decision for one training step.

A step is applied only if every gradient is finite (no NaN, +Inf or -Inf);
otherwise it is skipped, and no variable of the model, no optimizer slot or
accumulator and no rolled-back moving statistic changes. The decision is one
`tf.cond` whose two branches are built inside the functions passed to it.
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import rollback
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

GuardResult = collections.namedtuple("GuardResult", [
    "train_op", "applied", "nonfinite_flags", "variable_names", "counters",
    "update_flags", "update_variable_names"
])
GuardResult.__doc__ = """What `guarded_apply` built.

Attributes:
  train_op: the step's train op (decision, update or skip, counters,
    global_step).
  applied: bool scalar tensor, True if this step's update was applied.
  nonfinite_flags: bool vector tensor, one flag per checked gradient (True =
    the gradient held a NaN or an Inf), aligned with `variable_names`.
  variable_names: Python list of the checked variables' names.
  counters: `SkipCounters` of int64 tensors read after the step.
  update_flags: bool vector tensor, one flag per floating-point variable
    written by the update ops (e.g. a batch-norm moving statistic), True if
    its value after them holds a NaN or an Inf; aligned with
    `update_variable_names`.
  update_variable_names: Python list of those variables' names.
"""


def _values(grad):
  if isinstance(grad, tf.IndexedSlices):
    return grad.values
  return grad


def _check(values):
  """Builds the exact test of `values`, on their device (see is_nonfinite)."""
  with values.graph.colocate_with(values.op), tf1.name_scope("is_nonfinite"):
    return tf.logical_not(tf.reduce_all(tf.math.is_finite(values)))


def is_nonfinite(grad):
  """Returns a bool scalar: True if `grad` holds any NaN, +Inf or -Inf.

  The test is exact, element by element (`tf.math.is_finite`), and never a sum
  or norm of the raw values, which would overflow into a false positive for
  large finite gradients. It runs on the gradient's own device.

  A tensor is checked once per graph: asking again for the same tensor
  (outside control flow) returns the same flag, so a report's per-tower
  flags and a decision's flags share their ops when both see one tower's
  gradients (the check is a pass over every gradient; bench/guard_overhead.py
  measures it). The check reads nothing but `grad`, so it is built free of
  the caller's control dependencies.

  Args:
    grad: a float Tensor (float16, bfloat16, float32, float64) or an
      `IndexedSlices`, whose `.values` are checked.

  Returns:
    A bool scalar tensor.
  """
  values = _values(grad)
  graph = values.graph
  # pylint: disable=protected-access
  in_control_flow = graph._get_control_flow_context() is not None
  # pylint: enable=protected-access
  if (graph is not tf1.get_default_graph() or graph.building_function or
      in_control_flow):
    # Inside a cond, a loop or a function a flag belongs to that context.
    return _check(values)
  checks = getattr(graph, _CHECKS_ATTRIBUTE, None)
  if checks is None:
    checks = {}
    setattr(graph, _CHECKS_ATTRIBUTE, checks)
  flag = checks.get(values.ref())
  if flag is None:
    with tf1.control_dependencies(None):
      flag = _check(values)
    checks[values.ref()] = flag
  return flag


# Flags already built in a graph, by checked tensor. An attribute of the graph
# (not a module-level map, whose values would keep every graph alive).
_CHECKS_ATTRIBUTE = "_tf1_safe_train_nonfinite_checks"


def _written_is_nonfinite(variable):
  """Like is_nonfinite, of `variable`'s value read under the caller's deps.

  A resource variable gets a new read. A ref variable's value is read by the
  check itself from the variable's ref: Grappler may rewrite an Identity read
  of a ref variable (`read_value()`) into the variable's cached snapshot,
  which can run before the updates the caller's control dependencies name.
  """
  if rollback.is_ref_variable(variable):
    return _check(variable._ref())  # pylint: disable=protected-access
  return _check(variable.read_value())


def sum_duplicates(grad):
  """`grad` with the values of repeated `IndexedSlices` indices summed.

  The wrapped optimizers sum them before applying
  (`Optimizer._deduplicate_indexed_slices`, same ops): checked before that
  sum, two finite values of one embedding row (2e38 + 2e38 in float32) would
  pass and write -Inf. Dense gradients and None are returned as they are.

  Args:
    grad: a Tensor, an `IndexedSlices` or None.

  Returns:
    `grad`, or an `IndexedSlices` with unique indices in first-seen order
    (unique indices keep their values, as in the optimizer's own sum).
  """
  if not isinstance(grad, tf.IndexedSlices):
    return grad
  graph = grad.values.graph
  with graph.colocate_with(grad.values.op), tf1.name_scope("sum_duplicates"):
    unique, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, positions,
                                          tf.shape(unique)[0])
  return tf.IndexedSlices(values, unique, grad.dense_shape)


def nonfinite_flags(grads):
  """Returns a bool vector with one `is_nonfinite` flag per non-None gradient.

  Args:
    grads: a list of gradients; `None` entries are ignored.

  Returns:
    A bool tensor of shape [number of non-None gradients].
  """
  flags = [is_nonfinite(g) for g in grads if g is not None]
  if not flags:
    return tf.zeros([0], dtype=tf.bool)
  return tf.stack(flags)


def any_nonfinite(grads):
  """Returns a bool scalar: True if any of `grads` holds a NaN or an Inf.

  One fused check for many tensors (a tower's gradients), whose ops do not
  grow per tensor the way one `is_nonfinite` chain each does: tensors of one
  dtype and the same shape but the first dimension are concatenated along it
  and checked by one exact `is_finite` pass per such group; the others are
  flattened (a `Reshape`, no kernel launch on a GPU) into one more group. It
  says whether, not which: per-tensor flags are the decision's.
  `IndexedSlices` are checked through their values, `None` entries ignored.
  """
  values = [g.values if isinstance(g, tf.IndexedSlices) else g
            for g in grads if g is not None]
  if not values:
    return tf.constant(False)
  with tf1.name_scope("any_nonfinite"):
    groups = collections.OrderedDict()
    for v in values:
      shape = v.shape
      key = ((v.dtype.base_dtype, tuple(shape[1:].as_list()))
             if shape.rank and shape[1:].is_fully_defined() else None)
      groups.setdefault(key, []).append(v)
    checked = []
    flat = collections.OrderedDict()
    for key, vs in groups.items():
      if key is not None and len(vs) > 1:
        checked.append(tf.concat(vs, axis=0))
      else:
        for v in vs:
          flat.setdefault(v.dtype.base_dtype, []).append(
              v if v.shape.rank == 1 else tf.reshape(v, [-1]))
    checked += [vs[0] if len(vs) == 1 else tf.concat(vs, axis=0)
                for vs in flat.values()]
    flags = [tf.reduce_all(tf.math.is_finite(c)) for c in checked]
    return tf.logical_not(flags[0] if len(flags) == 1
                          else tf.reduce_all(tf.stack(flags)))


def _increment(variable):
  return tf1.assign_add(variable, tf.constant(1, dtype=variable.dtype.base_dtype))


def guarded_apply(grads_and_vars,
                  apply_fn,
                  global_step=None,
                  increment_global_step_on_skip=True,
                  update_ops=None,
                  extra_nonfinite=(),
                  branch_ops=(),
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
      e.g. one per tower from `reduce_any(nonfinite_flags(tower_grads))`.
    branch_ops: objects with `on_apply()` and `on_skip()` methods returning
      ops, built inside the apply (after the update) and skip branches, e.g.
      a `loss_scale.DynamicLossScale`.
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
  counters = counters_lib.skip_counters()
  protected = rollback.Rollback(rollback.written_variables(update_ops))
  with tf1.name_scope(name):
    # The check and the update see the same values: sparse gradients summed.
    grads_and_vars = tuple((sum_duplicates(g), v) for g, v in grads_and_vars)
    checked = [(g, v) for g, v in grads_and_vars if g is not None]
    flags = nonfinite_flags([g for g, _ in checked])
    nonfinite = tf.reduce_any(flags)
    for extra in extra_nonfinite:
      nonfinite = tf.logical_or(nonfinite, extra)
    # The decision checks the values the forward-pass updates wrote, and
    # waits for those updates, so the branches see (and save or undo) them.
    # Integer variables (e.g. counters an update op bumps) cannot be NaN.
    checked_writes = [v for v in protected.variables
                      if v.dtype.base_dtype.is_floating]
    updates = [rollback.as_op(u) for u in update_ops]
    if checked_writes:
      with tf1.control_dependencies(updates):
        update_flags = tf.stack([_written_is_nonfinite(v)
                                 for v in checked_writes])
      nonfinite = tf.logical_or(nonfinite, tf.reduce_any(update_flags))
    else:
      update_flags = tf.zeros([0], tf.bool)
    # Built outside the block above, `nonfinite` gets the control inputs here
    # (TF leaves them off an op whose inputs were built under them).
    with tf1.control_dependencies(updates):
      all_finite = tf.logical_not(nonfinite, name="all_finite")

    def _apply_branch():
      with tf1.name_scope("apply"):
        update = apply_fn(list(grads_and_vars))
        with tf1.control_dependencies([update]):
          steps = [protected.commit(),
                   _increment(counters.applied_steps),
                   *[b.on_apply() for b in branch_ops],
                   tf1.assign(counters.consecutive_skips,
                              tf.constant(0, dtype=tf.int64))]
          if global_step is not None and not increment_global_step_on_skip:
            steps.append(_increment(global_step))
        with tf1.control_dependencies(steps):
          return tf.identity(tf.constant(True))

    def _skip_branch():
      with tf1.name_scope("skip"):
        steps = [protected.restore(),
                 _increment(counters.skipped_steps),
                 *[b.on_skip() for b in branch_ops],
                 _increment(counters.consecutive_skips)]
        with tf1.control_dependencies(steps):
          return tf.identity(tf.constant(False))

    touched = ([v for _, v in checked] + protected.variables + list(counters) +
               ([global_step] if global_step is not None else []))
    with rollback.control_flow_for(touched):
      applied = tf.cond(all_finite, _apply_branch, _skip_branch, name="decide")
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
      counters=counters_lib.read_after(counters, train_op))
