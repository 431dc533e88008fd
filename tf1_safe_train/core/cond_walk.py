"""Walking into conds: the control-flow primitives both write searches share.

`writes` (which variables update ops write, to roll them back) and
`write_check` (what a fetched train op writes outside its decision) both
follow a value through v1 control flow and into v2 cond branches; they do it
with these functions, so there is one walker of conds.
"""

# Op types a variable's handle or ref goes through on its way to the op that
# writes it (v1 control flow passes it through a Switch or an Enter).
HANDLE_OP_TYPES = frozenset(["Identity", "RefIdentity", "Switch", "RefSwitch",
                             "Enter", "RefEnter"])
# v2 conds: functional ops whose branches are FuncGraphs (see branch_graphs).
V2_COND_OP_TYPES = frozenset(["If", "StatelessIf", "Case", "StatelessCase"])


def contexts(op):
  """The v1 cond and loop contexts `op` is built in, innermost first."""
  ctx = op._get_control_flow_context()  # pylint: disable=protected-access
  found = []
  while ctx is not None:
    found.append(ctx)
    ctx = ctx.outer_context
  return found


def branch_graphs(op):
  """The FuncGraphs of a v2 cond's branches, or None if they are unknown."""
  # cond_v2 keeps them on the op (tensorflow/python/ops/cond_v2.py); an
  # imported graph has only the function names, found in its library.
  if op.type in ("If", "StatelessIf"):
    names = ["_true_graph", "_false_graph"]
    functions = [op.get_attr("then_branch"), op.get_attr("else_branch")]
  else:
    functions = op.get_attr("branches")
    names = ["_branch_graph_%d" % i for i in range(len(functions))]
  graphs = [getattr(op, n, None) for n in names]
  if any(g is None for g in graphs):
    library = [op.graph._get_function(f.name) for f in functions]  # pylint: disable=protected-access
    graphs = [getattr(f, "graph", None) for f in library if f is not None]
    if len(graphs) != len(functions):
      return None
  return None if any(g is None for g in graphs) else graphs


def branch_ops(op, bindings):
  """Every op of a v2 cond's branches, nested conds' too, in build order.

  A function runs all its stateful ops, so every op is yielded (a nested
  cond's own op before its branches' ops). A cond whose branches are
  unknown (`branch_graphs` is None) is yielded but not entered.

  Args:
    op: the cond op (`V2_COND_OP_TYPES`), whose branches are known.
    bindings: dict, filled as branches are entered: placeholder op of a
      branch input -> the cond's input tensor it stands for (`origin`
      follows them out).

  Yields:
    Operations.
  """
  for graph in branch_graphs(op):
    for inner, outer in zip(graph.inputs, op.inputs[1:]):  # 0: predicate
      bindings[inner.op] = outer
    for inner in graph.get_operations():
      yield inner
      if inner.type in V2_COND_OP_TYPES and branch_graphs(inner) is not None:
        yield from branch_ops(inner, bindings)


def origin(tensor, bindings, through=HANDLE_OP_TYPES, stop=()):
  """The op `tensor` comes from, through `through` ops and branch inputs.

  Args:
    tensor: a Tensor.
    bindings: as filled by `branch_ops` (branch input -> cond input).
    through: op types followed through their first input.
    stop: ops where the walk ends (e.g. the variables' ops).
  """
  op = tensor.op
  while op not in stop:
    if op.type in through and op.inputs:
      op = op.inputs[0].op
    elif op in bindings:
      op = bindings[op].op
    else:
      break
  return op
