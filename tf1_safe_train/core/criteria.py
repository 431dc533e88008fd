"""Skip criteria: one object per reason a step may be skipped.

A `Criterion` decides from the step's `Context` (checked gradients, loss,
the non-finite verdict, per-tower values) whether to skip it, keeps its own
state, builds its updates inside the decision's branches and says what it
saw for the reports. `guard.guarded_apply` or-s the criteria's flags into
its one `tf.cond` (`Decision`) and counts every skip once, under the first
criterion that fired: one int64 counter per reason, `<reason>_skips`.
"""

import re

import tensorflow as tf

from tf1_safe_train.core import criterion_spec
from tf1_safe_train.core import norms

tf1 = tf.compat.v1

# Variables a checkpoint written without them lacks (a criterion's state, a
# reason's counter, an option's state): a resume initialises them afresh
# instead of failing (`trainer/checkpoint/checkpoint_fit.py`).
OPTIONAL_STATE = "tf1_safe_train_optional_state"
# Every reason's counters, `<reason>_skips` and `<reason>_would_skips`.
COUNTERS_COLLECTION = "tf1_safe_train_reason_counters"
NONFINITE = criterion_spec.NONFINITE
# A reason counter's device type (an int64 scalar: host memory anyway).
COUNTER_DEVICE = "/device:CPU:0"
_REASON = re.compile(r"^[a-z][a-z0-9_]*$")


class Context(object):
  """What a criterion decides from (tensors of one step), built once.

  Attributes:
    grads_and_vars: the checked (gradient, variable) pairs (no None
      gradient; sparse ones summed), with the variables written by update
      ops' deltas when the step checks statistics.
    loss: the step's float scalar loss (built on first read when the step
      has it as a function: a step pays for nothing no criterion reads).
    nonfinite: bool scalar, the non-finite verdict (a gradient or a written
      statistic held a NaN or an Inf).
    towers: dict of per-tower values, first axis the tower (e.g. "loss",
      "nonfinite"), as the caller gave them (`apply_gradients(
      tower_values=...)`); empty when not given. A value is a tensor, a
      function building it (e.g. "grad_norm": built only if a criterion
      calls it) or Python data (e.g. "device": the towers' devices).
    global_norm: float32 scalar, the trainable variables' gradients' global
      norm (`norms.global_norm`: no overflow for finite gradients), built
      once, on first read.
    degraded: bool scalar, True on an applied step a left-out tower
      overflowed (the tower unit's), or None.
    skip_nonfinite: in the skip branch, bool scalar, True if the skip is a
      non-finite one; None when every skip is (one acting criterion).
  """

  def __init__(self, grads_and_vars, loss, nonfinite, towers=None):
    self.grads_and_vars = list(grads_and_vars)
    self._loss = loss
    self.nonfinite = nonfinite
    self._towers = dict(towers or {})
    self._norm = None
    self.degraded = None
    self.skip_nonfinite = None

  @property
  def loss(self):
    """The step's loss.

    Raises:
      ValueError: if the step has none (a sync replicas' chief decides on
        the aggregate gradients, with no loss; the wrapper was given no
        loss tensor).
    """
    if callable(self._loss):
      self._loss = self._loss()
    if self._loss is None:
      raise ValueError(
          "a skip criterion reads the step's loss, which this step does not "
          "have (sync replicas decide on the chief, with no loss; the "
          "wrapper needs a loss tensor given to compute_gradients or "
          "apply_gradients(loss=))")
    return self._loss

  @property
  def has_loss(self):
    """True if the step has a loss (reading it then raises no error)."""
    return self._loss is not None

  @property
  def towers(self):
    return self._towers

  @property
  def global_norm(self):
    if self._norm is None:
      grads = [g for g, v in self.grads_and_vars
               if g is not None and getattr(v, "trainable", True)]
      self._norm = norms.global_norm(grads)
    return self._norm


def state_variable(name, value):
  """A criterion's state variable: not trained, optional in checkpoints.

  Build it under `tf1.init_scope()` (e.g. in the criterion's constructor),
  so a criterion made inside a branch or a control-dependency block still
  makes plain variables.
  """
  return tf1.Variable(value, name=name, trainable=False, collections=[
      tf1.GraphKeys.GLOBAL_VARIABLES, OPTIONAL_STATE])


# A reason counter's name (TensorFlow-free, for the early checks' modules).
counter_name = criterion_spec.counter_name
counter_reason = criterion_spec.counter_reason


def reason_counter(reason, dry_run=False, graph=None, initial_fn=None):
  """The graph's counter of `reason` (`counter(counter_name(...))`)."""
  return counter(counter_name(reason, dry_run), graph, initial_fn)


def counter(name, graph=None, initial_fn=None):
  """The graph's int64 counter `name` (e.g. "spike_skips"), made once.

  At the graph's root, on the current job and task (a parameter server
  under a `replica_device_setter`) and their CPU: an explicit device, which
  lets the skip branch name it through a handle of its own
  (`reasons.Decision.on_skip`); optional in checkpoints: a checkpoint
  written before the reason existed restores, the count starting at 0 (or
  at `initial_fn()`, built under `init_scope`).
  """
  graph = graph or tf1.get_default_graph()
  for variable in graph.get_collection(COUNTERS_COLLECTION):
    if variable.op.name == name:
      return variable
  with graph.as_default(), tf1.init_scope(), graph.name_scope(None):
    with tf1.device(COUNTER_DEVICE):
      variable = state_variable(name, initial_fn() if initial_fn else
                                tf.constant(0, tf.int64))
  graph.add_to_collection(COUNTERS_COLLECTION, variable)
  return variable


class Criterion(object):
  """One reason to skip a step; subclass it and pass an instance to the
  wrapper (`SkipNonFiniteOptimizer(criteria=[...])`) or the trainer's step
  (`train_step.build_step(criteria=[...])`); a criterion with a flag of
  `//:train` is declared by a spec (`criterion_spec.CriterionSpec`).

  The guard calls, once per built step and in this order: `decide` (before
  the decision: it must write nothing), then `on_apply` inside the apply
  branch (after the update) and `on_skip` inside the skip branch; the
  reports fetch the values `decide` returned with every step and call
  `describe` and `record` on those of a step the criterion skipped (or, in
  a dry run, would have skipped). The guard keeps its counters:
  `<reason>_skips` (skips labelled with this reason) and, for a dry run,
  `<reason>_would_skips`. A criterion that reads `Context.loss` needs the
  step's loss: with none (sync replicas' chief), building the step raises.

  Attributes:
    reason: the skip's label in the log line, skips.jsonl ("reason"),
      TensorBoard (`skips/<reason>_skips`) and run_summary.json
      ("skips_by_reason"); lower case, digits and underscores.
    dry_run: if True the criterion only reports what it would skip (its
      flag never skips the step: the step is applied, and `on_apply` runs).
  """

  reason = None
  dry_run = False

  def decide(self, context):
    """(flag, values), built before the cond: the flag a bool scalar tensor,
    True to skip the step; values a dict of scalar tensors the reports show
    (its values, thresholds; they run with every step: keep them cheap).

    (A flag alone is accepted too, the values then coming from `values()`:
    criteria written before `decide` returned them.)
    """
    raise NotImplementedError

  def on_apply(self, context):  # pylint: disable=unused-argument
    """Ops for the apply branch (e.g. fold the step into statistics)."""
    return []

  def on_skip(self, context):  # pylint: disable=unused-argument
    """Ops for the skip branch (e.g. count a streak)."""
    return []

  @property
  def variables(self):
    """The criterion's state variables (`state_variable`)."""
    return []

  def values(self):
    """Deprecated: the values of a `decide` that returned its flag alone."""
    return {}

  def describe(self, values):
    """The line's words after "skipped step N: <reason>" from the fetched
    values (e.g. "loss 12 > threshold 10"), or ""."""
    return ", ".join("%s %.4g" % (k, v) for k, v in sorted(values.items()))

  def record(self, values):
    """The skips.jsonl record's `<reason>` field from fetched values."""
    return {k: (v.item() if hasattr(v, "item") else v)
            for k, v in values.items()}


def decision(criterion, context):
  """`criterion`'s (flag, values) for the step of `context`."""
  decided = criterion.decide(context)
  if isinstance(decided, tuple):
    flag, values = decided
    return flag, dict(values)
  return decided, dict(criterion.values())


class NonFinite(Criterion):
  """A gradient or a statistic written by an update op holds a NaN/Inf.

  The guard computes the verdict itself (fused checks; the report's
  per-variable flags are its own) and hands it in `Context.nonfinite`.
  """

  reason = NONFINITE

  def decide(self, context):
    return context.nonfinite, {}


def check(criterion):
  """Returns `criterion`; raises ValueError if it is no usable Criterion."""
  if not isinstance(criterion, Criterion):
    raise ValueError("a skip criterion must be a criteria.Criterion, got %r"
                     % (criterion,))
  reason = criterion.reason
  if not (isinstance(reason, str) and _REASON.match(reason)):
    raise ValueError("criterion %r: reason=%r must be lower case letters, "
                     "digits and underscores" % (criterion, reason))
  if not isinstance(criterion.dry_run, bool):
    raise ValueError("criterion %r: dry_run=%r must be a boolean" %
                     (criterion, criterion.dry_run))
  return criterion


def with_nonfinite(criteria):
  """`[NonFinite()] + criteria`, checked; reasons must be distinct."""
  criteria = [NonFinite()] + [check(c) for c in criteria]
  reasons = [c.reason for c in criteria]
  repeated = sorted(set(r for r in reasons if reasons.count(r) > 1))
  if repeated:
    raise ValueError("two skip criteria have the reason %s" %
                     ", ".join(repeated))
  return criteria
