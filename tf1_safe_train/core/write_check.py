"""What a run of a guarded step does that a skip cannot undo or count once.

A skipped step changes nothing only of what the decision holds: the update
in its apply branch, the rolled-back statistics and `protect()`ed ops. An
`ExponentialMovingAverage` grouped into the train op without `protect()`, or
an update op grouped after `apply_gradients`, still writes on a skipped step.
`unguarded_writes` names those variables by walking everything a run of the
train op executes; `findings` also finds a run of several guarded steps
(one step counted and decided several times), a `global_step` that the
step and the script both advance, another fetch of the run whose writes
read what the step writes, and a run of no step that writes statistics a
skip restores (`run_writes` says whose each write is); `run_advice.tell`
warns once per graph (or, strict, refuses the run).
"""

import collections

import tensorflow as tf
# Only to keep GUARD_RESULTS out of exported meta graphs (see below).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import loss_scale_stacking
from tf1_safe_train.core import run_advice
from tf1_safe_train.core import run_writes

tf1 = tf.compat.v1

# Graph collection of the `guard.GuardResult` of every step the wrapper
# builds (`optimizer.SkipNonFiniteOptimizer` fills it).
GUARD_RESULTS = "tf1_safe_train_guard_results"
# They are Python tuples, which a meta-graph export (every checkpoint of a
# MonitoredTrainingSession) cannot serialize and warns about: export nothing.
tf_ops.register_proto_function(
    GUARD_RESULTS, to_proto=lambda result, export_scope=None: None)

_WRITE_TYPE = run_writes.WRITE_TYPE
_origin = run_writes.origin
decision_contexts = run_writes.decision_contexts


def handled_variable_names(graph):
  """Names of variables a skip accounts for: global_step, the counters, and
  metrics' (`tf.compat.v1.metrics` totals and counts, which Keras' metrics
  also keep: a metric counts what was run, skipped steps too)."""
  names = set(v.op.name for v in
              graph.get_collection(tf1.GraphKeys.GLOBAL_STEP))
  names.update(v.op.name for v in graph.get_collection(
      counters_lib.COLLECTION))
  names.update(v.op.name for v in graph.get_collection(
      tf1.GraphKeys.METRIC_VARIABLES))
  return names


def _names(graph, writes, handled, left):
  """Sorted names of what `writes` write, but `handled` (names) and `left`
  (variable ops): variables, or "<op name> (writes <target>)" for a target
  that is not a graph variable."""
  variables = {v.op: v for v in
               graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES) +
               graph.get_collection(tf1.GraphKeys.LOCAL_VARIABLES)}
  found = set()
  for w in writes:
    if w.target in left:
      continue
    if w.target in variables:
      name = variables[w.target].op.name
      if name not in handled:
        found.add(name)
    elif w.target.name not in handled:
      found.add("%s (writes %s)" % (w.op.name, w.target.name))
  return sorted(found)


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
  writes = run_writes.of_run(fetch_gate.ancestors(ops, fed), decisions)
  # A rollback (`protect()`) that this run executes assigns a variable from
  # its shadow: that variable is fine, and so is the shadow's own update.
  # A script's loss-scale cond writes its scale on the same verdict.
  handled = (handled_variable_names(graph) | set(handled_names) |
             loss_scale_stacking.loss_scale_cond_writes(ops, fed))
  return _names(graph, writes, handled, run_writes.restored(graph, writes))


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
    "steps", "unguarded", "global_steps", "runners", "others", "between"])
Findings.__new__.__defaults__ = ((), ())
Findings.__doc__ = """What a run does wrong (`findings`).

Attributes:
  steps: the `Step`s the run executes (several: one step counted several
    times).
  unguarded: names of the variables the fetches that run a step write
    outside every decision (`unguarded_writes`).
  global_steps: (variable name, [names of the other ops writing it]) for
    each global_step a step advances and the run also writes outside it.
  runners: the fetched ops that execute a step (what the user would
    protect), or all fetched ops if none does.
  others: (fetched op, [names]) for each other fetch of the run that
    writes variables from values read from what the steps write (an
    `ExponentialMovingAverage` fetched beside the train op); their other
    writes (a metric, a learning rate set by the script) are its own.
  between: names of the statistics a skip restores that a run of no step
    writes (an evaluation of a loss between steps, in-place batch norm).
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


def _runners(ops, callers, walks, decided):
  """The fetched ops that execute a step: the caller's first, if any."""
  runners = []
  for candidates in (callers or [], ops):
    runners = runners or [op for op in candidates if decided & (
        walks[op] if op in walks else fetch_gate.ancestors([op]))]
  return runners


def _other_fetches(graph, ops, walks, own, writes, handled, left, steps,
                   fed):
  """`Findings.others`: other fetches' writes that read what `steps`
  write (local variables are theirs: a script's own bookkeeping)."""
  theirs = [w for w in writes if w.at not in own]
  if not theirs:
    return []  # The usual run: no walk of the steps.
  products = run_writes.written_by_steps(steps)
  handled = handled | set(v.op.name for v in graph.get_collection(
      tf1.GraphKeys.LOCAL_VARIABLES))
  theirs = [w for w in theirs if run_writes.reads(w, products, fed)]
  found = []
  for op in sorted(set(ops) - set(own), key=lambda o: o.name):
    names = _names(graph, [w for w in theirs if w.at in walks[op]], handled,
                   left)
    if names:
      found.append((op, names))
  return found


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
    `Findings`; for a run that executes none of `steps` (an evaluation
    run), unless `always`, only the restored statistics it writes.
  """
  if not ops:
    return Findings([], [], [], [])
  graph = ops[0].graph
  walked = fetch_gate.ancestors(ops, fed)
  ran = [s for s in steps if s.applied.op in walked]
  decisions = [r.applied for r in graph.get_collection(GUARD_RESULTS)]
  writes = run_writes.of_run(walked, decisions)
  if not (ran or always):
    between = run_writes.restored_between_steps(graph, writes)
    return Findings([], [], [], [], between=sorted(v.name for v in between))
  handled = (handled_variable_names(graph) |
             loss_scale_stacking.loss_scale_cond_writes(ops, fed))
  for step in steps:
    handled.update(step.handled_names)
  walks = ({op: fetch_gate.ancestors([op], fed) for op in set(ops)}
           if len(set(ops)) > 1 else {ops[0]: walked})
  decided = set(s.applied.op for s in ran)
  # What the fetches that run a step execute: their writes are the step's.
  own = (set().union(*[walk for walk in walks.values() if decided & walk])
         if ran else walked)
  left = run_writes.restored(graph, writes)
  return Findings(
      ran, _names(graph, [w for w in writes if w.at in own], handled, left),
      _global_steps_twice(walked, ran),
      _runners(ops, callers, walks, decided) or ops,
      others=_other_fetches(graph, ops, walks, own, writes, handled, left,
                            ran, fed) if ran else [])


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
