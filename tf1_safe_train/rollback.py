"""Variables written outside the apply/skip decision: rollback, or deltas.

Batch-norm moving statistics are written by update ops built during the
forward pass, outside the `tf.cond` that decides a step, so they cannot be
moved into its apply branch. Each such variable gets a shadow copy: the apply
branch copies the variable into its shadow, the skip branch copies the shadow
back, so after a skipped step the variable holds its last applied value again.
In a cluster (`statistics_deltas`) the writes become deltas applied with the
decision instead.
"""

import tensorflow as tf
# Only to keep the shadows' collection out of exported meta graphs (below).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

tf1 = tf.compat.v1

# Op types that write the variable given as their first input.
_WRITE_OP_TYPES = frozenset([
    "Assign", "AssignAdd", "AssignSub",
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ScatterUpdate", "ScatterAdd", "ScatterSub",
    "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub",
])
# Op types an update op may be wrapped in (identity, group, read-after-write).
_PASS_THROUGH_OP_TYPES = frozenset(["Identity", "IdentityN", "NoOp",
                                    "ReadVariableOp"])
# Graph collection of (variable, shadow) pairs, so shadows are made once.
_SHADOWS_COLLECTION = "tf1_safe_train_rollback_shadows"
# A meta-graph export (every checkpoint of a MonitoredTrainingSession) cannot
# serialize Python pairs and would warn about them: export nothing (the
# shadows themselves are saved as the variables they are).
tf_ops.register_proto_function(
    _SHADOWS_COLLECTION, to_proto=lambda pair, export_scope=None: None)


def as_op(op_or_tensor):
  """Returns the Operation of an Operation, a Tensor or a variable read."""
  # Tensors, Operations and resource variables' lazy reads all have `.op`
  # except Operations themselves.
  return op_or_tensor if isinstance(op_or_tensor, tf1.Operation) else (
      op_or_tensor.op)


def _variable_ops(graph):
  """Maps each variable's defining op to the variable."""
  variables = (graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES) +
               graph.get_collection(tf1.GraphKeys.LOCAL_VARIABLES))
  return {v.op: v for v in variables}


def find_writes(update_ops):
  """Follows `update_ops` to the ops that write variables.

  Each update op is followed through identities, groups and reads until the
  ops that write a variable (`AssignSub` for the usual moving average, any
  assign or scatter); the search stops there, so it never walks the forward
  pass.

  Args:
    update_ops: Operations, Tensors or variable reads, e.g. the contents of
      `tf.compat.v1.GraphKeys.UPDATE_OPS`.

  Returns:
    (writes, others): `writes` lists (write op, variable) pairs in the order
    found; `others` lists the ops reached that neither write a variable nor
    pass through (for callers that accept only some kinds of update).

  Raises:
    ValueError: if an update op writes something that is not a variable of the
      graph's global or local variables collections.
  """
  if not update_ops:
    return [], []
  ops = [as_op(u) for u in update_ops]
  var_ops = _variable_ops(ops[0].graph)
  writes, others, seen, stack = [], [], set(), list(reversed(ops))
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    if op.type in _WRITE_OP_TYPES:
      target = op.inputs[0].op
      while target not in var_ops and target.type == "Identity":
        target = target.inputs[0].op
      if target not in var_ops:
        raise ValueError(
            "update op %s writes %s, which is not a global or local variable "
            "and cannot be rolled back on a skipped step" % (op.name,
                                                             target.name))
      writes.append((op, var_ops[target]))
    elif op.type in _PASS_THROUGH_OP_TYPES:
      stack.extend(reversed([t.op for t in op.inputs] +
                            list(op.control_inputs)))
    elif op not in var_ops:
      others.append(op)
  return writes, others


def written_variables(update_ops):
  """Returns the variables written by `update_ops`, sorted by name.

  Args:
    update_ops: as for `find_writes`.

  Returns:
    A list of variables.

  Raises:
    ValueError: as `find_writes`.
  """
  writes, _ = find_writes(update_ops)
  found = {v.op.name: v for _, v in writes}
  return [found[name] for name in sorted(found)]


def _shadow(variable):
  """Returns the shadow of `variable`, creating it on first use."""
  graph = variable.graph
  for var, shadow in graph.get_collection(_SHADOWS_COLLECTION):
    if var is variable:
      return shadow
  with tf1.init_scope(), graph.name_scope(None), tf1.colocate_with(variable):
    # Saved in checkpoints with the variable: after a restart, a skip must
    # restore the restored value, not the initial one.
    shadow = tf1.Variable(
        variable.initial_value,
        name=variable.op.name + "/skip_shadow",
        trainable=False,
        collections=[tf1.GraphKeys.GLOBAL_VARIABLES],
        use_resource=hasattr(variable, "handle"))
  graph.add_to_collection(_SHADOWS_COLLECTION, (variable, shadow))
  return shadow


class Rollback(object):
  """Shadow copies of variables, saved on apply and restored on skip."""

  def __init__(self, variables):
    """Creates (or reuses) a shadow for each variable.

    Args:
      variables: the variables to protect.
    """
    self._pairs = [(v, _shadow(v)) for v in variables]

  @property
  def variables(self):
    return [v for v, _ in self._pairs]

  def commit(self, name="commit"):
    """Op for the apply branch: each shadow takes its variable's value."""
    with tf1.name_scope(name):
      return tf.group(*[tf1.assign(s, v.read_value()) for v, s in self._pairs])

  def restore(self, name="restore"):
    """Op for the skip branch: each variable takes back its shadow's value."""
    with tf1.name_scope(name):
      return tf.group(*[tf1.assign(v, s.read_value()) for v, s in self._pairs])


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
      graph variable (moving averages are).
  """
  writes, others = find_writes(update_ops)
  unsupported = others + [op for op, _ in writes
                          if op.type not in _ADD_SUB_SIGNS]
  if unsupported:
    op = unsupported[0]
    raise ValueError(
        "update op %s (%s): in a cluster, update ops are applied with the "
        "step's decision, which supports assign_add/assign_sub (moving "
        "averages) only" % (op.name, op.type))
  deltas, order = {}, []
  for op, variable in writes:
    value = op.inputs[1]
    if _ADD_SUB_SIGNS[op.type] < 0:
      value = tf.negative(value)
    if variable.op not in deltas:
      order.append(variable)
    deltas.setdefault(variable.op, []).append(value)
  return [(tf.add_n(deltas[v.op]) if len(deltas[v.op]) > 1
           else deltas[v.op][0], v) for v in order]
