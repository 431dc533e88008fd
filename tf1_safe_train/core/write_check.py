"""What a run of a guarded step does that a skip cannot undo or count once.

A skipped step changes nothing only of what the decision holds: the update
in its apply branch, the rolled-back statistics and `protect()`ed ops. An
`ExponentialMovingAverage` grouped into the train op without `protect()`, or
an update op grouped after `apply_gradients`, still writes on a skipped step.
`unguarded_writes` names those variables by walking everything a run of the
train op executes; `findings` also finds a run of several guarded steps
(one step counted and decided several times) and a `global_step` that the
step and the script both advance; `tell` warns once per graph (or, strict,
refuses the run).
"""

import collections
import re

import tensorflow as tf
# Only to keep GUARD_RESULTS out of exported meta graphs (see below).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train.core import cond_walk
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import loss_scale_stacking
from tf1_safe_train.core import run_advice
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


def unguarded_writes(ops, decisions, handled_names=(), fed=frozenset()):
  """The variables a run of `ops` writes outside every guarded decision.

  Args:
    ops: the Operations a run fetches (e.g. the train op).
    decisions: the `applied` tensors of the guarded steps in the graph.
    handled_names: more names of variables that are fine to write (e.g.
      the loss scale's).
    fed: names of the run's fed tensors (not computed: not walked).

  Returns:
    A sorted list of names: variables, or for a write whose target is not a
    graph variable, "<op name> (writes <target>)".
  """
  if not ops:
    return []
  graph = ops[0].graph
  inside = decision_contexts(decisions)
  handled = (handled_variable_names(graph) | set(handled_names) |
             loss_scale_stacking.loss_scale_cond_writes(ops, fed))
  variables = {v.op: v for v in
               graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES) +
               graph.get_collection(tf1.GraphKeys.LOCAL_VARIABLES)}
  # A v2 decision's branches are functions: not entered, all inside.
  decision_ops = set(a.op for a in decisions)
  decision_ops.update(a.op.inputs[0].op for a in decisions
                      if a.op.type == "Identity")
  writes = []
  for op in fetch_gate.ancestors(ops, fed):
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


def decisions_run(ops, decisions, fed=frozenset()):
  """Those of `decisions` (`applied` tensors) a run of `ops` executes."""
  walked = fetch_gate.ancestors(ops, fed)
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
    raise ValueError(run_advice.several_steps(ops, ran))


# One guarded step, as the checks see it (`SkipNonFiniteOptimizer` makes
# one per step it builds).
Step = collections.namedtuple("Step", [
    "applied", "train_op", "global_step", "handled_names", "strict"])
Step.__doc__ = """One guarded step, for `findings`.

Attributes:
  applied: the step's `applied` tensor (its decision).
  train_op: the step's train op (the guard's).
  global_step: the variable the step advances, or None.
  handled_names: names of the variables the step itself handles (counters,
    rolled-back statistics, loss scale, global_step).
  strict: refuse the run instead of warning.
"""

Findings = collections.namedtuple("Findings", [
    "steps", "unguarded", "global_steps", "runners"])
Findings.__doc__ = """What a run does wrong (`findings`).

Attributes:
  steps: the `Step`s the run executes (several: one step counted several
    times).
  unguarded: names of the variables it writes outside every decision
    (`unguarded_writes`).
  global_steps: (variable name, [names of the other ops writing it]) for
    each global_step a step advances and the run also writes outside it.
  runners: the fetched ops that execute a step (what the user would
    protect), or all fetched ops if none does.
"""


def _global_steps_twice(walked, steps):
  """`Findings.global_steps` of a run that executes `walked` and `steps`."""
  found = {}
  for step in steps:
    if step.global_step is None or step.global_step.op.name in found:
      continue
    own = fetch_gate.ancestors([step.train_op])
    others = sorted(
        op.name for op in walked
        if op not in own and _WRITE_TYPE.match(op.type) and op.inputs and
        _origin(op.inputs[0], {}) is step.global_step.op)
    if others:
      found[step.global_step.op.name] = others
  return sorted(found.items())


def findings(ops, steps, fed=frozenset(), always=False, callers=None):
  """What a run of `ops` does that a skip cannot undo or count once.

  Args:
    ops: the Operations a run fetches.
    steps: the `Step`s to look for.
    fed: names of the run's fed tensors.
    always: also name unguarded writes of a run that executes none of
      `steps` (an explicit check of a train op).
    callers: the fetched ops to name first as what runs a step (the
      caller's, not its hooks'); default: `ops`.

  Returns:
    `Findings`; all empty for a run that executes none of `steps` (an
    evaluation run), unless `always`.
  """
  if not ops:
    return Findings([], [], [], [])
  walked = fetch_gate.ancestors(ops, fed)
  ran = [s for s in steps if s.applied.op in walked]
  if not (ran or always):
    return Findings([], [], [], [])
  decisions = [r.applied for r in ops[0].graph.get_collection(GUARD_RESULTS)]
  handled = set()
  for step in steps:
    handled.update(step.handled_names)
  decided = set(s.applied.op for s in ran)
  runners = []
  for candidates in (callers or [], ops):
    runners = runners or [op for op in candidates if ran and
                          decided & fetch_gate.ancestors([op], fed)]
  return Findings(ran, unguarded_writes(ops, decisions, handled, fed),
                  _global_steps_twice(walked, ran), runners or ops)


def check(ops, step):
  """Warns about (strict: refuses) what a run of `ops` does outside `step`.

  For `check_train_op`: writes outside the decision, and a global_step the
  step and the run both advance, each told once (`run_advice.tell`).

  Args:
    ops: the Operations a run fetches.
    step: the wrapper's last `Step`.

  Returns:
    The unguarded variables' names (see `unguarded_writes`), then for a
    global_step advanced twice "<name> (advanced twice: also by <ops>)".

  Raises:
    ValueError: if the run executes more than one guarded step (it would
      count and decide the step twice), or, if `step.strict`, for any write
      outside the decision.
  """
  check_one_step(ops)
  found = findings(ops, [step], always=True)
  run_advice.tell(ops, found, step.strict)
  return found.unguarded + [
      "%s (advanced twice: also by %s)" % (name, ", ".join(others))
      for name, others in found.global_steps]
