"""A step's skip criteria decided, and what the reports read of them.

`Decision` or-s the criteria's flags into the guard's predicate and builds
their branch ops, the skip branch counting the skip once, under the first
criterion that fired (its label). `Report` is what every report reads of
it (the wrapper's line and skips.jsonl, the trainer's hooks, forensics,
TensorBoard, run_summary.json): per reason its flag, values and counters;
the label of a skip; a dry-run criterion's would-be skip. What the
reports say of them (lines, records, tags, counts) is `skip_report`'s.
"""

import functools

import tensorflow as tf

from tf1_safe_train.core import criteria as criteria_lib

tf1 = tf.compat.v1

NONFINITE = criteria_lib.NONFINITE


def _increment(variable, by=None):
  return tf1.assign_add(variable, tf.constant(1, tf.int64) if by is None
                        else tf.cast(by, tf.int64))


def _increment_in_branch(variable, by):
  """`variable += by` for the skip branch, through a handle of its own.

  A variable's handle that the skip branch alone captures costs every good
  step two nodes: its `VarHandleOp` and the `Switch` a v2 cond's lowering
  adds per captured tensor. A second `VarHandleOp` of the same resource
  (container, shared name and the explicit device `criteria.counter`
  gives a reason counter), built in the branch, runs on skipped steps
  only. A ref variable (legacy code; a v1 cond) or one without a device
  is captured.
  """
  op = variable.op
  if op.type != "VarHandleOp" or not op.device:
    return _increment(variable, by)
  # No device function either: a replica_device_setter would place this
  # handle anew (round robin), on another task than the resource's.
  with tf1.device(None), tf1.device(op.device):
    handle = tf.raw_ops.VarHandleOp(
        dtype=op.get_attr("dtype"), shape=op.get_attr("shape"),
        container=op.get_attr("container"),
        shared_name=op.get_attr("shared_name"), name=op.name)
    return tf.raw_ops.AssignAddVariableOp(resource=handle,
                                          value=tf.cast(by, tf.int64))


def _counters(acting, skipped_steps):
  """The acting criteria's counters, non-finite's first.

  Until a second criterion can skip, skipped_steps is the non-finite
  count: a checkpoint written so lacks `nonfinite_skips`, which then
  starts (`checkpoint_fit`'s fresh variables) at skipped_steps minus the
  other reasons' restored counts.
  """
  others = [criteria_lib.reason_counter(c.reason) for c in acting[1:]]

  def value(counter):
    # A counter not yet initialised (a fresh run) counts 0 so far.
    return tf.cond(tf1.is_variable_initialized(counter), counter.read_value,
                   lambda: tf.constant(0, tf.int64))

  def nonfinite_initial():
    return value(skipped_steps) - functools.reduce(
        tf.add, [value(c) for c in others])

  return [criteria_lib.reason_counter(NONFINITE,
                                      initial_fn=nonfinite_initial)] + others


class Decision(object):
  """The criteria of one step: their flags, the predicate, branch ops."""

  def __init__(self, criteria, context, skipped_steps):
    """Builds each criterion's flag (before the `tf.cond`).

    Args:
      criteria: `criteria.with_nonfinite(...)`: `NonFinite` first.
      context: the step's `criteria.Context`.
      skipped_steps: the skip counter; with one criterion that can skip
        (the default: non-finite alone) it is that reason's counter, so
        the graph and its checkpoints are those from before criteria.
    """
    self.criteria = list(criteria)
    self.context = context
    decided = [criteria_lib.decision(c, context) for c in self.criteria]
    self.flags = [flag for flag, _ in decided]
    # What each criterion saw, for the reports (returned, not stashed).
    self.values = {c.reason: values
                   for c, (_, values) in zip(self.criteria, decided)}
    self._acting = [(c, f) for c, f in zip(self.criteria, self.flags)
                    if not c.dry_run]
    self.counters = ([skipped_steps] if len(self._acting) == 1 else
                     _counters([c for c, _ in self._acting], skipped_steps))
    self.would_counters = [(criteria_lib.reason_counter(c.reason, True), f)
                           for c, f in zip(self.criteria, self.flags)
                           if c.dry_run]
    # (One acting criterion, the default: the predicate is its flag.)
    self.skip = functools.reduce(tf.logical_or,
                                 [f for _, f in self._acting])

  @property
  def variables(self):
    """Every variable the branches write for the criteria."""
    return (self.counters[len(self._acting) == 1:] +
            [v for v, _ in self.would_counters] +
            [v for c in self.criteria[1:] for v in c.variables])

  def _branch_ops(self, build):
    """Each criterion's ops `build(criterion)` for a branch of the cond.

    An acting criterion's flag is (part of) the cond's predicate, so its
    reads of its state come before either branch writes that state. A
    dry-run flag is not: without a control dependency on it, its reads
    race with the branch's writes (a spike threshold read after the apply
    branch folded the step's own norm in missed about one spike in eight).
    The dependency is on an identity of the flag built in the branch: a
    v2 cond's branch drops control inputs from outside it. That identity
    is one node more per step, in dry runs only.
    """
    ops = []
    for c, f in zip(self.criteria, self.flags):
      with tf1.control_dependencies([tf.identity(f)] if c.dry_run else []):
        ops += tf.nest.flatten(build(c))
    return ops

  def on_apply(self):
    """The apply branch's ops: each criterion's, and would-be skips."""
    ops = self._branch_ops(lambda c: c.on_apply(self.context))
    return ops + [_increment(v, f) for v, f in self.would_counters]

  @property
  def labels(self):
    """True if the skip branch counts the label (more than one acting
    criterion): it then needs `on_skip`'s `nonfinite`."""
    return len(self.counters) > 1

  def on_skip(self, nonfinite=None):
    """The skip branch's ops: each criterion's, the label's counter.

    Args:
      nonfinite: the non-finite verdict as the skip branch computes it
        from what it reads anyway (the guard's per-tensor flags), or None
        to capture the context's: each captured tensor costs a good step
        a `Switch`.
    """
    ops = self._branch_ops(lambda c: c.on_skip(self.context))
    if not self.labels:  # skipped_steps: the guard counts it.
      return ops
    flags = [f for _, f in self._acting]
    if nonfinite is not None:
      flags[0] = nonfinite
    earlier = tf.constant(False)
    for counter, flag in zip(self.counters, flags):
      ops.append(_increment_in_branch(counter, tf.logical_and(
          flag, tf.logical_not(earlier))))
      earlier = tf.logical_or(earlier, flag)
    return ops

  def report(self, op):
    """The step's `Report`, its counters read after `op`."""
    names = ([criteria_lib.counter_name(c.reason) for c, _ in self._acting] +
             [criteria_lib.counter_name(c.reason, True)
              for c in self.criteria if c.dry_run])
    variables = self.counters + [v for v, _ in self.would_counters]
    return Report(self.criteria, dict(
        (c.reason, f) for c, f in zip(self.criteria, self.flags)),
                  dict(zip(names, variables)), self.variables, op,
                  values=self.values)


class Report(object):
  """What the reports fetch and say of a step's criteria.

  Attributes:
    criteria: the criteria, `NonFinite` first.
    fetches: dict to fetch with the step (its flags and values).
    counts: dict counter name ("nonfinite_skips", "spike_would_skips")
      -> int64 tensor read after the step (the run summary's, TensorBoard's).
    variables: the variables the decision writes for the criteria
      (counters, the criteria's state).
  """

  def __init__(self, criteria, flags, counters, variables, op, values=None):
    self.criteria = list(criteria)
    self._counters = counters
    self.variables = list(variables)
    self.counts = self.read_after(op)
    if values is None:  # (Criteria whose `decide` stashed them.)
      values = {c.reason: c.values() for c in self.criteria}
    self.fetches = {"fired": flags, "values": values}

  def read_after(self, op):
    """The counters (`counts`), read after `op` (e.g. a trainer's step,
    which runs more than the guard's)."""
    with tf1.name_scope("read_skip_reasons"), tf1.control_dependencies([op]):
      return {name: tf.identity(v.read_value())
              for name, v in self._counters.items()}

  def label(self, values):
    """The reason of a skipped step from fetched `fetches`: the first
    acting criterion that fired ("nonfinite" if none did: e.g. another
    worker's gradients)."""
    return next((c.reason for c in self.criteria
                 if not c.dry_run and values["fired"][c.reason]), NONFINITE)

  def would_skip(self, values):
    """The dry-run criteria that would have skipped the step."""
    return [c for c in self.criteria
            if c.dry_run and values["fired"][c.reason]]

  def criterion(self, reason):
    return next(c for c in self.criteria if c.reason == reason)
