"""What a run writes outside the guarded decisions, and whose each write is.

`of_run` lists the write ops (assigns, scatters, optimizers' apply kernels)
a run of some fetches executes outside every decision, each with the
variable it writes and where its value comes from. Whose a write is
decides what the first-run check says about it (`write_check.findings`):
the fetch that runs the step owns its writes; another fetch's write is the
script's own business unless it reads a variable the step writes (`reads`);
a run of no step that writes a variable a skip restores
(`restored_between_steps`) has its write undone by the next skip.
"""

import collections
import re

import tensorflow as tf

from tf1_safe_train.core import cond_walk
from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import shadows as shadows_lib

tf1 = tf.compat.v1

# Ops that write the variable (ref or resource handle) of their first input:
# assigns, scatters, optimizers' apply kernels.
WRITE_TYPE = re.compile(
    r"^(Assign|(Resource)?(Sparse)?Apply|(Resource)?Scatter|"
    r"(Resource)?StridedSliceAssign)")
# Ops a variable's ref, handle or value passes through on its way to a write.
# A flat shadow's restore splits and reshapes it (`shadows`).
_FORWARDING_TYPES = frozenset([
    "Identity", "RefIdentity", "Switch", "RefSwitch", "Enter", "RefEnter",
    "ReadVariableOp", "SplitV", "Reshape"])
# Where a value that sets a variable rather than updating it comes from:
# a checkpoint restore, a fed or constant value (Keras' set_weights).
_SETTING_TYPES = frozenset([
    "RestoreV2", "Restore", "RestoreSlice", "Placeholder", "PlaceholderV2",
    "PlaceholderWithDefault", "Const"])

# One write a run executes: the write op, the op of the variable written,
# the op the written value comes from (None for a write without a value),
# and the op of the run's graph that executes it (the write op, or the v2
# cond whose branch holds it).
Write = collections.namedtuple("Write", ["op", "target", "source", "at"])
Write.__new__.__defaults__ = (None,)


def origin(tensor, bindings):
  """The op a tensor comes from, through identities, reads, v1 conds and
  v2 branch inputs."""
  return cond_walk.origin(tensor, bindings, through=_FORWARDING_TYPES)


def write(op, bindings=None):
  """The `Write` of a write op (the value's origin tells a rollback, a
  variable assigned from its shadow, from any other write)."""
  bindings = {} if bindings is None else bindings
  return Write(op, origin(op.inputs[0], bindings),
               origin(op.inputs[1], bindings) if len(op.inputs) > 1 else None,
               op)


def _v2_cond_writes(cond):
  """`Write`s of a v2 cond's branches, nested, in `cond`'s graph's terms."""
  if cond_walk.branch_graphs(cond) is None:
    return []
  bindings = {}
  return [write(op, bindings)._replace(at=cond)
          for op in cond_walk.branch_ops(cond, bindings)
          if WRITE_TYPE.match(op.type) and op.inputs]


def decision_contexts(decisions):
  """The v1 cond branch contexts of `decisions` (their `applied` tensors).

  A v2 decision (an `If` op) has none: its branches are functions, which
  `of_run` does not enter.
  """
  contexts = set()
  for applied in decisions:
    if applied.op.type in ("Merge", "RefMerge"):
      for branch in applied.op.inputs:
        context = branch.op._get_control_flow_context()  # pylint: disable=protected-access
        if context is not None:
          contexts.add(context)
  return contexts


def of_run(walked, decisions):
  """The `Write`s among `walked` (the ops a run executes) outside every
  decision (the `applied` tensors of the guarded steps)."""
  inside = decision_contexts(decisions)
  # A v2 decision's branches are functions: not entered, all inside.
  decision_ops = set(a.op for a in decisions)
  decision_ops.update(a.op.inputs[0].op for a in decisions
                      if a.op.type == "Identity")
  writes = []
  for op in walked:
    if op.type in cond_walk.V2_COND_OP_TYPES and op not in decision_ops:
      writes += _v2_cond_writes(op)
    elif (WRITE_TYPE.match(op.type) and op.inputs and
          not any(c in inside for c in cond_walk.contexts(op))):
      writes.append(write(op))
  return writes


def restored(graph, writes):
  """Ops of the variables a skip restores that `writes` leave alone: the
  shadows, and the variables a run of `writes` assigns from their shadow
  (a `protect()`ed rollback)."""
  shadows = shadows_lib.shadowed(graph)
  return set(shadows) | set(w.target for w in writes
                            if w.target in shadows.get(w.source, ()))


def written_by_steps(steps):
  """Ops of the variables `steps` (`write_check.Step`s) write, in their
  decisions too: what a skipped step leaves as it was."""
  found = set()
  for step in steps:
    for op in fetch_gate.ancestors([step.train_op]):
      if op.type in cond_walk.V2_COND_OP_TYPES:
        found.update(w.target for w in _v2_cond_writes(op))
      elif WRITE_TYPE.match(op.type) and op.inputs:
        found.add(write(op).target)
  return found


def reads(write_, variables, fed=frozenset()):
  """True if the value `write_` (a `Write`) writes is computed from one of
  `variables` (ops). The variable written is not followed; for a write in
  a v2 cond, everything the cond reads is."""
  if write_.at is not write_.op:
    starts = [t.op for t in write_.at.inputs]
  else:
    starts = [t.op for t in write_.op.inputs[1:]]
  starts += list(write_.at.control_inputs)
  return bool(fetch_gate.ancestors(starts, fed) & variables)


def restored_between_steps(graph, writes):
  """Ops of the variables a skip restores (shadowed statistics) that
  `writes` update from a computed value: not an initializer, a restore or a
  fed value. A run of no step that makes such a write has it undone by the
  next skip (and a NaN it writes makes the next step skip)."""
  held = set().union(*shadows_lib.shadowed(graph).values())
  initializers = set(
      v.initializer for v in graph.get_collection(
          tf1.GraphKeys.GLOBAL_VARIABLES) + graph.get_collection(
              tf1.GraphKeys.LOCAL_VARIABLES))
  return set(w.target for w in writes
             if w.target in held and w.op not in initializers and
             w.source is not None and w.source.type not in _SETTING_TYPES)
