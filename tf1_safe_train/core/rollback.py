"""Variables written outside the apply/skip decision: rollback, or deltas.

Batch-norm moving statistics are written by update ops built during the
forward pass, outside the `tf.cond` that decides a step, so they cannot be
moved into its apply branch. Each such variable has a shadow copy (`shadows`:
small ones share a flat one): the apply branch copies the variables into
their shadows, the skip branch copies the shadows back, so after a skipped
step every variable holds its last applied value again.
Which variables an update op writes is found by `writes`; writes the
forward pass makes in place (in no collection) by `in_place`. In a cluster
(`statistics_deltas`) the writes become deltas applied with the decision
instead.
"""

import contextlib

import tensorflow as tf
# Only to choose the cond implementation for ref variables (see below).
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train.core import in_place
from tf1_safe_train.core import shadows as shadows_lib
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

# The search for written variables lives in `writes`; these names stay here
# for callers that import only this module.
as_op = writes.as_op
find_writes = writes.find_writes
written_variables = writes.written_variables
is_ref_variable = shadows_lib.is_ref_variable


class Rollback(object):
  """Shadow copies of variables, saved on apply and restored on skip."""

  def __init__(self, variables):
    """Finds (or creates) the shadows of `variables` (see `shadows`).

    Args:
      variables: the variables to protect.
    """
    self._variables = list(variables)
    self._shadows = shadows_lib.shadows_for(self._variables)

  @property
  def variables(self):
    return list(self._variables)

  def values(self):
    """The shadowed variables' values now: one tensor per shadow.

    Built under the caller's control dependencies (e.g. after the update
    ops); `commit(values)` saves them, and a decision can check them, so
    the apply branch reads no variable of its own.
    """
    return [s.value() for s in self._shadows]

  def commit(self, values=None, name="commit"):
    """Op for the apply branch: each shadow takes its variables' value.

    Args:
      values: `values()`, built before the branch; default: read in it.
      name: name scope.
    """
    values = values or [None] * len(self._shadows)
    with tf1.name_scope(name):
      return tf.group(*[s.commit(v) for s, v in zip(self._shadows, values)])

  def restore(self, name="restore"):
    """Op for the skip branch: each variable takes back its shadow's value."""
    with tf1.name_scope(name):
      return tf.group(*[s.restore() for s in self._shadows])


# Update-op writes `var += sign * value` that a cluster turns into deltas.
_ADD_SUB_SIGNS = {"AssignSubVariableOp": 1, "AssignSub": 1,
                  "AssignAddVariableOp": -1, "AssignAdd": -1}


def statistics_deltas(update_ops):
  """The writes of `update_ops` as (delta, variable) pairs: `var -= delta`.

  In a cluster the moving statistics are not written by the forward pass
  and rolled back on a skip: the rollback shadows on a ps are shared by the
  workers, so one worker's commit can save another's NaN into them (seen
  with resnet20 and a poisoned input). Instead each delta travels with the
  gradients and is applied inside the decision's apply branch (averaged over
  the replicas with --sync_replicas).

  Args:
    update_ops: ops of `UPDATE_OPS` (followed through identities and
      groups).

  Returns:
    A list of (delta tensor, variable), one per written variable.

  Raises:
    ValueError: for an update op that is not an assign_add/assign_sub of a
      graph variable (moving averages are), e.g. one inside a cond (a batch
      norm whose `training` is a tensor): its delta cannot leave the cond.
  """
  written, others = find_writes(update_ops)
  for op, variable in written:
    if writes.in_control_flow(op):
      raise ValueError(
          "update op %s writes %s inside a cond: in a cluster, update ops "
          "are applied with the step's decision as deltas, which cannot be "
          "taken out of a cond (give batch norm a Python bool `training`)" %
          (writes.op_name(op), variable.op.name))
  unsupported = others + [op for op, _ in written
                          if op.type not in _ADD_SUB_SIGNS]
  if unsupported:
    op = unsupported[0]
    raise ValueError(
        "update op %s (%s): in a cluster, update ops are applied with the "
        "step's decision, which supports assign_add/assign_sub (moving "
        "averages) only" % (op.name, op.type))
  deltas, order = {}, []
  for op, variable in written:
    value = op.inputs[1]
    if _ADD_SUB_SIGNS[op.type] < 0:
      value = tf.negative(value)
    if variable.op not in deltas:
      order.append(variable)
    deltas.setdefault(variable.op, []).append(value)
  return [(tf.add_n(deltas[v.op]) if len(deltas[v.op]) > 1
           else deltas[v.op][0], v) for v in order]


@contextlib.contextmanager
def control_flow_for(variables):
  """Builds a `tf.cond` that can capture `variables`.

  Control flow v2 builds the branches as functions, which cannot capture ref
  variables (`tf.compat.v1.disable_resource_variables()`, legacy code): for
  those the decision is built with v1 control flow, which TF still supports
  in graph mode. Resource variables keep whatever implementation is enabled.

  Args:
    variables: every variable the branches read or write.

  Yields:
    Nothing; the cond is built inside the block.
  """
  if not (control_flow_util.ENABLE_CONTROL_FLOW_V2 and
          any(is_ref_variable(v) for v in variables)):
    yield
    return
  control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
  try:
    yield
  finally:
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = True


def protect(ops, applied, handled_names, step_roots=(), name="protect"):
  """`ops`, then keep (`applied`) or undo what they wrote (see the wrapper).

  The written variables are found as for `UPDATE_OPS` (assign and scatter
  ops, followed through `tf.group`, `tf.identity` and reads), and among the
  ancestors of `ops` as for the step (`in_place`: statistics the forward
  pass assigns, when the step was given other `update_ops`); each costs one
  shadow variable (saved in checkpoints) and one copy per step.

  Args:
    ops: Operations whose written variables are kept on an applied step and
      take back their last applied value on a skipped one.
    applied: the decided step's bool `applied` tensor.
    handled_names: names of variables the step itself handles (left alone).
    step_roots: the decided step's `step_roots`: the in-place writes among
      their ancestors are protected too (the decision hides them from a
      walk that starts at `ops`).
    name: name scope of the added ops.

  Returns:
    An Operation.
  """
  protected = Rollback([v for v in written_variables(
      ops + in_place.run_before(ops + list(step_roots)))
                        if v.op.name not in handled_names])
  with tf1.name_scope(name):
    if not protected.variables:
      return tf.group(*ops, name="unchanged")
    # Decide only once `ops` have written and the step has been decided.
    with tf1.control_dependencies(ops):
      applied = tf.identity(applied, name="applied")

    def _keep():
      with tf1.control_dependencies([protected.commit()]):
        return tf.identity(tf.constant(True))

    def _undo():
      with tf1.control_dependencies([protected.restore()]):
        return tf.identity(tf.constant(False))

    with control_flow_for(protected.variables):
      decided = tf.cond(applied, _keep, _undo, name="keep_or_undo")
    writes.register_decision(decided)
    return tf.group(*(ops + [decided]), name="protected")


def step_roots(tensors, probe_name):
  """The ops a step starts its search for update ops from (see below).

  Args:
    tensors: Tensors or IndexedSlices: the gradients, and the losses given
      to `compute_gradients`.
    probe_name: name of the NoOp that reads the caller's control
      dependencies.

  Returns:
    The caller's control dependencies and the ops of `tensors`.
  """
  # A NoOp built here carries the caller's `control_dependencies` as its
  # control inputs: the public way to read them.
  probe = tf.no_op(name=probe_name)
  return list(probe.control_inputs) + [
      t.op for t in tf.nest.flatten(tensors, expand_composites=True)]


def update_ops_run_by(roots, own=()):
  """The ops a step runs anyway that write variables, as its update ops.

  First the `UPDATE_OPS` entries among the ancestors of `roots` (from
  `step_roots`): the caller's control dependencies (the legacy idiom: `with
  tf.control_dependencies(update_ops)` around `apply_gradients`, the first
  tower's statistics only), the gradients and the losses given to
  `compute_gradients` (tf-slim's `create_train_op` puts its update ops in a
  barrier the loss depends on), in the collection's order. Then the writes
  among those ancestors that are in no collection (`in_place`: batch norm
  with `updates_collections=None` assigns its statistics in the forward
  pass). Variables written in conds (a batch norm whose `training` is a
  tensor) are found by `writes` too. One backward walk over the graph for
  the entries, one for the in-place writes.

  Args:
    roots: Operations.
    own: variables the step writes itself (its `global_step`): never
      taken as in-place writes.
  """
  everything = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
  entries = {as_op(u) for u in everything}
  stack, found, seen = list(roots), set(), set()
  while stack and len(found) < len(entries):
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    if op in entries:
      found.add(op)
    stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
  run = [u for u in everything if as_op(u) in found]
  ops = set(as_op(u) for u in run)
  return run + [op for op in in_place.run_before(roots, own)
                if op not in ops]
