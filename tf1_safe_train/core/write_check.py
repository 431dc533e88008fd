"""Variables a fetched train op writes outside its step's decision.

A skipped step changes nothing only of what the decision holds: the update
in its apply branch, the rolled-back statistics and `protect()`ed ops. An
`ExponentialMovingAverage` grouped into the train op without `protect()`, or
an update op grouped after `apply_gradients`, still writes on a skipped step.
`unguarded_writes` names those variables by walking everything a run of the
train op executes; `check` warns (or, strict, refuses), and also refuses a
run that executes two guarded steps, which would count one step twice.
"""

import re

from absl import logging
import tensorflow as tf
# Only to keep GUARD_RESULTS out of exported meta graphs (see below).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train.core import cond_walk
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import shadows as shadows_lib

tf1 = tf.compat.v1

# Graph collection of the `guard.GuardResult` of every step the wrapper
# builds (`optimizer.SkipNonFiniteOptimizer` fills it).
GUARD_RESULTS = "tf1_safe_train_guard_results"
# They are Python tuples, which a meta-graph export (every checkpoint of a
# MonitoredTrainingSession) cannot serialize and warns about: export nothing.
tf_ops.register_proto_function(
    GUARD_RESULTS, to_proto=lambda result, export_scope=None: None)

# Ops that write the variable (ref or resource handle) of their first input:
# assigns, scatters, optimizers' apply kernels.
_WRITE_TYPE = re.compile(
    r"^(Assign|(Resource)?(Sparse)?Apply|(Resource)?Scatter|"
    r"(Resource)?StridedSliceAssign)")
# Ops a variable's ref, handle or value passes through on its way to a write.
# A flat shadow's restore splits and reshapes it (`shadows`).
_FORWARDING_TYPES = frozenset([
    "Identity", "RefIdentity", "Switch", "RefSwitch", "Enter", "RefEnter",
    "ReadVariableOp", "SplitV", "Reshape"])


def _origin(tensor, bindings):
  """The op a tensor comes from, through identities, reads, v1 conds and
  v2 branch inputs."""
  return cond_walk.origin(tensor, bindings, through=_FORWARDING_TYPES)


def _write(op, bindings=None):
  """(write op, op of the variable written, op the written value comes from).

  The value's origin tells a rollback (a variable assigned from its shadow)
  from any other write.
  """
  bindings = {} if bindings is None else bindings
  return (op, _origin(op.inputs[0], bindings),
          _origin(op.inputs[1], bindings) if len(op.inputs) > 1 else None)


def _v2_cond_writes(cond):
  """`_write`s of a v2 cond's branches, nested, in `cond`'s graph's terms."""
  if cond_walk.branch_graphs(cond) is None:
    return []
  bindings = {}
  return [_write(op, bindings)
          for op in cond_walk.branch_ops(cond, bindings)
          if _WRITE_TYPE.match(op.type) and op.inputs]


def decision_contexts(decisions):
  """The v1 cond branch contexts of `decisions` (their `applied` tensors).

  A v2 decision (an `If` op) has none: its branches are functions, which the
  walk of `unguarded_writes` does not enter.
  """
  contexts = set()
  for applied in decisions:
    if applied.op.type in ("Merge", "RefMerge"):
      for branch in applied.op.inputs:
        context = branch.op._get_control_flow_context()  # pylint: disable=protected-access
        if context is not None:
          contexts.add(context)
  return contexts


def handled_variable_names(graph):
  """Names of variables a skip accounts for: global_step and the counters."""
  names = set(v.op.name for v in
              graph.get_collection(tf1.GraphKeys.GLOBAL_STEP))
  names.update(v.op.name for v in graph.get_collection(
      counters_lib.COLLECTION))
  return names


def unguarded_writes(ops, decisions, handled_names=()):
  """The variables a run of `ops` writes outside every guarded decision.

  Args:
    ops: the Operations a run fetches (e.g. the train op).
    decisions: the `applied` tensors of the guarded steps in the graph.
    handled_names: more names of variables that are fine to write (e.g.
      the loss scale's).

  Returns:
    A sorted list of names: variables, or for a write whose target is not a
    graph variable, "<op name> (writes <target>)".
  """
  if not ops:
    return []
  graph = ops[0].graph
  inside = decision_contexts(decisions)
  handled = handled_variable_names(graph) | set(handled_names)
  variables = {v.op: v for v in
               graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES) +
               graph.get_collection(tf1.GraphKeys.LOCAL_VARIABLES)}
  # A v2 decision's branches are functions: not entered, all inside.
  decision_ops = set(a.op for a in decisions)
  decision_ops.update(a.op.inputs[0].op for a in decisions
                      if a.op.type == "Identity")
  writes = []
  for op in fetch_gate.ancestors(ops):
    if op.type in cond_walk.V2_COND_OP_TYPES and op not in decision_ops:
      writes += _v2_cond_writes(op)
    elif (_WRITE_TYPE.match(op.type) and op.inputs and
          not any(c in inside for c in cond_walk.contexts(op))):
      writes.append(_write(op))
  # A rollback (`protect()`) that this run executes assigns a variable from
  # its shadow: that variable is fine, and so is the shadow's own update.
  shadows = shadows_lib.shadowed(graph)
  restored = set(target for _, target, source in writes
                 if target in shadows.get(source, ()))
  found = set()
  for op, target, _ in writes:
    if target in shadows or target in restored:
      continue
    if target in variables:
      name = variables[target].op.name
      if name not in handled:
        found.add(name)
    elif target.name not in handled:
      found.add("%s (writes %s)" % (op.name, target.name))
  return sorted(found)


def decisions_run(ops, decisions):
  """Those of `decisions` (`applied` tensors) a run of `ops` executes."""
  walked = fetch_gate.ancestors(ops)
  return [d for d in decisions if d.op in walked]


def check_one_step(ops, decisions=None):
  """Refuses a run of `ops` that executes more than one guarded step.

  Args:
    ops: the Operations a run fetches.
    decisions: the `applied` tensors of the guarded steps; default: those
      in the graph's `GUARD_RESULTS`.

  Raises:
    ValueError: naming the steps, if the run executes more than one (each
      would count and decide the step alone).
  """
  if not ops:
    return
  if decisions is None:
    decisions = [r.applied for r in ops[0].graph.get_collection(
        GUARD_RESULTS)]
  if len(decisions) < 2:
    return  # Nothing to walk for.
  ran = decisions_run(ops, decisions)
  if len(ran) > 1:
    raise ValueError(
        "one session.run executes %d guarded steps (%s): each counts a step "
        "and decides alone; build one step over every device's gradients "
        "with SkipNonFiniteOptimizer.apply_gradients_per_device" % (
            len(ran), ", ".join(d.op.name for d in ran)))


def check(ops, decisions, handled_names=(), strict=False):
  """Warns about (strict: refuses) writes outside the decision of `ops`.

  Args:
    ops: the Operations a run fetches.
    decisions: the `applied` tensors of the guarded steps in the graph.
    handled_names: as for `unguarded_writes`.
    strict: raise instead of warning.

  Returns:
    The unguarded variables' names (see `unguarded_writes`).

  Raises:
    ValueError: if the run executes more than one guarded step (it would
      count and decide the step twice), or, if `strict`, for any write
      outside the decision.
  """
  check_one_step(ops, decisions)
  names = unguarded_writes(ops, decisions, handled_names)
  if names:
    message = (
        "the train op writes %d variable(s) outside the skip decision, "
        "which change on skipped steps too: %s (wrap the train op with "
        "opt.protect(), or build these writes into the step)" % (
            len(names), ", ".join(names)))
    if strict:
      raise ValueError(message)
    logging.warning("%s", message)
  return names
