"""Which variables update ops write: from each op back to its assign ops.

An update op (a batch-norm moving average from `UPDATE_OPS`, an EMA) is
followed through identities and groups, and into conds, to the ops that
write variables; anything written in a way this search cannot analyse is
refused when the graph is built. `rollback` restores what it finds.
"""

import tensorflow as tf

from tf1_safe_train.core import cond_walk

tf1 = tf.compat.v1

# Op types that write the variable given as their first input.
WRITE_OP_TYPES = frozenset([
    "Assign", "AssignAdd", "AssignSub",
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ScatterUpdate", "ScatterAdd", "ScatterSub",
    "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub",
])
# Op types an update op may be wrapped in (identity, group, read-after-write).
_PASS_THROUGH_OP_TYPES = frozenset(["Identity", "IdentityN", "NoOp",
                                    "ReadVariableOp"])
# Op types that take a variable's handle or ref and only read it.
_READ_OP_TYPES = frozenset(["ReadVariableOp", "ResourceGather",
                            "ResourceGatherNd", "VariableShape",
                            "VarIsInitializedOp", "IsVariableInitialized"])
# Op types that create a variable (in a graph's collections or not).
_VARIABLE_OP_TYPES = frozenset(["VarHandleOp", "VariableV2", "Variable"])
_HANDLE_OP_TYPES = cond_walk.HANDLE_OP_TYPES
# v1 control flow. A cond hands its result back through a Merge, a loop
# through an Exit: there the search enters the cond or loop.
_V1_RESULT_OP_TYPES = frozenset(["Merge", "RefMerge", "Exit", "RefExit"])
_V1_CONTROL_FLOW_OP_TYPES = _HANDLE_OP_TYPES | _V1_RESULT_OP_TYPES | frozenset(
    ["NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger"])
# Op types that may take a variable's handle or ref but never write it.
_NOT_WRITING_OP_TYPES = (_PASS_THROUGH_OP_TYPES | _READ_OP_TYPES |
                         _V1_CONTROL_FLOW_OP_TYPES)
_V2_COND_OP_TYPES = cond_walk.V2_COND_OP_TYPES
# Conds that are apply/skip decisions (see register_decision). An attribute
# of the graph: a module-level map would keep every graph alive.
_DECISIONS_ATTRIBUTE = "_tf1_safe_train_decisions"
# Where `_Search.visit` goes on: outside any v1 cond or loop, or nowhere.
_TOP, _STOP = object(), object()


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


def register_decision(output):
  """Marks the `tf.cond` that returned `output` as an apply/skip decision.

  `find_writes` does not follow into it: its branches' writes (the
  optimizer's update, counters, shadow copies) are the decision itself, not
  updates to roll back.

  Args:
    output: a Tensor returned by the decision's `tf.cond`.
  """
  op = output.op
  while op.type == "Identity":  # cond_v2 returns identities of its If's
    op = op.inputs[0].op
  decisions = getattr(op.graph, _DECISIONS_ATTRIBUTE, None)
  if decisions is None:
    decisions = set()
    setattr(op.graph, _DECISIONS_ATTRIBUTE, decisions)
  decisions.add(op)


def decisions(graph):
  """The ops of `graph`'s registered decisions (a set; see above)."""
  return getattr(graph, _DECISIONS_ATTRIBUTE, set())


_contexts = cond_walk.contexts


def op_name(op):
  """`op`'s name, prefixed by its function's for an op in a v2 cond branch."""
  if op.graph.building_function:
    return "%s/%s" % (op.graph.name, op.name)
  return op.name


def in_control_flow(op):
  """True if `op` is built in a cond or loop (v1 context or v2 branch)."""
  return bool(_contexts(op)) or op.graph.building_function


class _Search(object):
  """One search of `find_writes`: what it found, and how it names targets."""

  def __init__(self, graph):
    self.var_ops = _variable_ops(graph)
    self.decisions = decisions(graph)
    # Placeholder op in a v2 branch -> the cond's input it stands for.
    self.bindings = {}
    self.writes, self.others = [], []

  def target(self, tensor):
    """(variable or None, last op reached) for a handle or a ref."""
    op = cond_walk.origin(tensor, self.bindings, stop=self.var_ops)
    return self.var_ops.get(op), op

  def record(self, op):
    variable, last = self.target(op.inputs[0])
    if variable is None:
      raise ValueError(
          "update op %s writes %s, which is not a global or local variable "
          "and cannot be rolled back on a skipped step" % (op_name(op),
                                                           last.name))
    if any(c.IsWhileContext() for c in _contexts(op)):
      self.refuse(op, "writes %s inside a while loop" % variable.op.name)
    self.writes.append((op, variable))

  @staticmethod
  def refuse(op, what):
    raise ValueError(
        "update op %s (%s) %s; tf1_safe_train cannot analyse that write to "
        "roll it back on a skipped step: write it with assign, assign_add or "
        "assign_sub (inside a tf.cond is fine), or leave it out of the update "
        "ops" % (op_name(op), op.type, what))

  def check_unknown(self, op):
    """Refuses `op` if it may write a variable in a way not known here."""
    if op.type in _NOT_WRITING_OP_TYPES:
      return
    # pylint: disable=protected-access
    # A declared ref input may be written (Assign, ApplyGradientDescent...);
    # a stateful op may write through a resource handle (While, function
    # calls, ResourceApply...). Handles of iterators, tables or queues are
    # not variables: what is done to them is not rolled back anyway.
    handles = [t for t, declared in zip(op.inputs, op._input_types)
               if declared._is_ref_dtype]
    if op._is_stateful:
      handles += [t for t in op.inputs if t.dtype == tf.resource]
    for handle in handles:
      variable, last = self.target(handle)
      if variable is not None:
        self.refuse(op, "may write %s" % variable.op.name)
      if last.type in _VARIABLE_OP_TYPES:
        self.refuse(op, "may write %s (not a global or local variable)" %
                    last.name)

  def scan_branches(self, op):
    """Finds every write in a v2 cond's branches, nested conds included."""
    if cond_walk.branch_graphs(op) is None:
      self.check_unknown(op)
      return
    for inner in cond_walk.branch_ops(op, self.bindings):
      if inner.type in WRITE_OP_TYPES:
        self.record(inner)
      elif (inner.type not in _V2_COND_OP_TYPES or
            cond_walk.branch_graphs(inner) is None):
        self.check_unknown(inner)

  def visit(self, op, root):
    """Handles `op`; returns where to follow its inputs: _TOP, _STOP or root.

    Outside control flow (`root` is _TOP) the search passes only through
    identities and groups and stops at writes, so it never walks the forward
    pass. Inside a v1 cond or loop entered at its Merge or Exit (`root`: the
    context around it) it follows every input until the Switch or Enter that
    brings a value in from outside.
    """
    if op.type in WRITE_OP_TYPES:
      self.record(op)
      return _STOP if root is _TOP else root
    if op.type in _V2_COND_OP_TYPES:
      if root is _TOP:
        self.others.append(op)
      self.scan_branches(op)
      return _STOP if root is _TOP else root
    if op.type in _V1_RESULT_OP_TYPES:
      if root is _TOP:
        self.others.append(op)
        # A cond's Merge is built around the cond, a loop's Exit in it.
        ctxs = _contexts(op)[1 if op.type in ("Exit", "RefExit") else 0:]
        return ctxs[0] if ctxs else None
      return root
    if op.type in _PASS_THROUGH_OP_TYPES or (
        root is not _TOP and op.type in _READ_OP_TYPES):
      return root
    self.check_unknown(op)
    if root is _TOP:
      if op not in self.var_ops:
        self.others.append(op)
      return _STOP
    return root

  def run(self, ops):
    seen, stack = set(), [(op, _TOP) for op in reversed(ops)]
    while stack:
      op, root = stack.pop()
      if op in seen or op in self.decisions:
        continue
      seen.add(op)
      inner = self.visit(op, root)
      if inner is _STOP:
        continue
      for nxt in reversed([t.op for t in op.inputs] + list(op.control_inputs)):
        ctxs = _contexts(nxt)
        if inner is _TOP or (ctxs and ctxs[0] is not inner and (
            inner is None or inner in ctxs)):
          stack.append((nxt, inner))


def find_writes(update_ops):
  """Follows `update_ops` to the ops that write variables.

  Each update op is followed through identities, groups and reads until the
  ops that write a variable (`AssignSub` for the usual moving average, any
  assign or scatter); the search stops there, so it never walks the forward
  pass. It follows into conds (the moving averages of a batch norm whose
  `training` is a tensor are written in one): a v1 cond from its Merge back
  to the Switch ops that bring values in, a v2 cond (`If`, `Case`) through
  every op of its branch functions, nested conds too. Conds registered by
  `register_decision` are not entered.

  Args:
    update_ops: Operations, Tensors or variable reads, e.g. the contents of
      `tf.compat.v1.GraphKeys.UPDATE_OPS`.

  Returns:
    (writes, others): `writes` lists (write op, variable) pairs in the order
    found (`in_control_flow(op)` tells those inside a cond); `others` lists
    the ops reached outside control flow that neither write a variable nor
    pass through, and the conds entered (for callers that accept only some
    kinds of update).

  Raises:
    ValueError: if an update op writes something that is not a global or
      local variable, writes inside a while loop, or may write a variable in
      a way not known here (a write op of another type, a function call, a
      v2 loop or any stateful op given a variable's handle or ref): one line
      naming the op and the variable.
  """
  if not update_ops:
    return [], []
  ops = [as_op(u) for u in update_ops]
  search = _Search(ops[0].graph)
  search.run(ops)
  return search.writes, search.others


def written_variables(update_ops):
  """The variables written by `update_ops` (see `find_writes`), by name.

  Raises:
    ValueError: as `find_writes`.
  """
  writes, _ = find_writes(update_ops)
  found = {v.op.name: v for _, v in writes}
  return [found[name] for name in sorted(found)]
