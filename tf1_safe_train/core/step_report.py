"""The wrapper's skip report: the tensors a run fetches, the line it logs.

The trainer's report (step, towers and their devices, variables) for legacy
code: a `StepReport` holds the tensors to fetch with the train op and turns
their values into one line; `StepReportHook` does both in a
`MonitoredTrainingSession` and checks each new train op it sees
(`write_check`). The wrapper's methods that use them are `reporting`'s.
"""

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import hooks
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import raw_gradients
from tf1_safe_train.core import reasons
from tf1_safe_train.core import skip_report
from tf1_safe_train.core import tower_outliers

tf1 = tf.compat.v1


def device_of(grads_and_vars):
  """A tower's device: its gradients' (or, without one, its variables').

  For towers that share the variables (`tower_grads_and_vars`): the shared
  variables sit on one device, each tower's gradients on its own.
  """
  for g, _ in grads_and_vars:
    if g is not None and g.device:
      return g.device
  return variables_device(grads_and_vars)


def variables_device(grads_and_vars):
  """A device copy's device: its variables' (of those with a gradient).

  For per-device variable copies (`apply_gradients_per_device`): their
  gradients may all sit on one device (an all-reduce summed there), the
  variables do not.
  """
  for g, v in grads_and_vars:
    if g is not None and v.device:
      return v.device
  return ""


def step_index(result, global_step, increment_global_step_on_skip):
  """The index of the step of `result`, read after it: global_step at its start.

  Args:
    result: the step's `guard.GuardResult`.
    global_step: the variable the step advances, or None: the index is then
      the number of steps counted before it.
    increment_global_step_on_skip: the step's global_step policy.

  Returns:
    An int64 scalar tensor.
  """
  if global_step is None:
    counters = result.counters
    return counters.applied_steps + counters.skipped_steps - 1
  with tf1.control_dependencies([result.train_op]):
    after = tf.identity(global_step.read_value())
  # It moved by one unless the policy leaves it on skipped steps.
  moved = (tf.constant(1, after.dtype) if increment_global_step_on_skip
           else tf.cast(result.applied, after.dtype))
  return after - moved


class StepReport(object):
  """What to fetch with a guarded train op to report its skips."""

  def __init__(self, step, result, tower_flags=None, tower_devices=None,
               raw_flags=None):
    """Creates the report of one guarded step.

    Args:
      step: int64 scalar tensor, the step's index (global_step at its start).
      result: the step's `guard.GuardResult`.
      tower_flags: optional bool tensor [num_towers] (which tower had a
        non-finite gradient) or [num_towers, len(variable_names)] (of
        which variables: e.g. per device, `segment_flags`).
      tower_devices: the towers' device strings ("" if unknown).
      raw_flags: optional bool tensor aligned with the checked variables:
        their gradients as computed, before the script changed them
        (`raw_gradients.flags`), for a report without towers.
    """
    self._variable_names = list(result.variable_names)
    self._update_names = list(result.update_variable_names)
    self._tower_devices = list(tower_devices or [])
    self.fetches = {"step": step, "applied": result.applied,
                    "flags": result.nonfinite_flags,
                    "update_flags": result.update_flags}
    if tower_flags is not None:
      self.fetches["towers"] = tower_flags
    elif raw_flags is not None:
      self.fetches["raw_flags"] = raw_flags
    self.reasons = result.reasons
    if result.reasons is not None:
      self.fetches["criteria"] = result.reasons.fetches

  @property
  def tower_devices(self):
    """The towers' devices ("" if unknown); [] if no towers were given."""
    return list(self._tower_devices)

  @property
  def criteria(self):
    """The step's criteria, or None (a sync replica's view)."""
    return self.reasons.criteria if self.reasons is not None else None

  def label(self, values):
    """The reason of a run's skip from its fetched `fetches` (None if the
    step was applied): its first criterion that fired."""
    if values["applied"]:
      return None
    if "criteria" not in values:
      return reasons.NONFINITE
    return self.reasons.label(values["criteria"])

  def would_skip(self, values):
    """The reasons of dry-run criteria that would have skipped the run."""
    if not values["applied"] or "criteria" not in values:
      return []
    return [c.reason for c in self.reasons.would_skip(values["criteria"])]

  def dry_run_lines(self, values):
    """One line per dry-run criterion that would have skipped the run."""
    if not values["applied"] or "criteria" not in values:
      return []
    return skip_report.dry_run_lines(self.reasons, int(values["step"]),
                                     values["criteria"])

  def nonfinite_words(self, values):
    """Where the run's NaN/Inf was (`skip_report.nonfinite_words`; without
    towers, the variables as computed), or None if no gradient was."""
    flags = np.asarray(values["flags"], dtype=bool)
    if not flags.any():
      return None
    if "towers" in values:
      return skip_report.nonfinite_words(values["towers"], flags,
                                         self._variable_names,
                                         self._tower_devices)
    return "non-finite gradients; variables: %s" % raw_gradients.describe(
        lambda f: skip_report.names(self._variable_names, f), flags,
        values.get("raw_flags"))

  def describe(self, values):
    """The report line of a run's fetched `fetches`, or None if applied.

    Args:
      values: what `session.run(report.fetches)` returned (with the train
        op, in the same run).

    Returns:
      A string such as "skipped step 7: non-finite gradients in tower 1
      (/device:GPU:1); variables: conv1/weights", or None.
    """
    if values["applied"]:
      return None
    reason = self.label(values)
    if reason != reasons.NONFINITE:
      return skip_report.line(int(values["step"]), reason, self.reasons,
                              values["criteria"])
    update_flags = np.asarray(values["update_flags"], dtype=bool)
    return skip_report.line(
        int(values["step"]), nonfinite=self.nonfinite_words(values),
        suffixes=["non-finite values written by update ops: %s" %
                  skip_report.names(self._update_names, update_flags)]
        if update_flags.any() else [])

  def record(self, values, reason, device, worker, **fields):
    """The skips.jsonl record of a run from its fetched `fetches`.

    Args:
      values: the fetched `fetches` of the skipped (or, for a dry-run
        `reason`, applied) run.
      reason: the skip's label (`label`), or a dry-run criterion's.
      device: the device of the gradients, for a report without towers.
      worker: the worker's task index.
      **fields: more fields (e.g. dry_run=True).
    """
    flags = np.asarray(values["flags"], bool)
    bad_names = [n for n, bad in zip(self._variable_names, flags) if bad]
    devices = self._tower_devices
    if "towers" in values:
      # One fused flag per tower; the averaged gradients' flags name the
      # variables (a NaN/Inf of any tower survives averaging).
      tower_bad = np.asarray(values["towers"], bool).reshape(
          len(devices), -1).any(axis=1)
    else:
      tower_bad, devices = [flags.any()], [device]
    update_flags = np.asarray(values["update_flags"], bool)
    return skip_report.record(
        values["step"], worker, reason, self.reasons, values.get("criteria"),
        towers=skip_report.towers(devices, tower_bad, bad_names),
        variables=bad_names,
        update_variables=[n for n, bad in zip(self._update_names,
                                              update_flags) if bad],
        **fields)


def tower_flags(grads_and_vars, tower_grads_and_vars):
  """One fused flag per tower, over the gradients of the checked variables.

  Fetched with every step, so one `nonfinite.any_nonfinite` per tower (a
  few kernels), not a check per gradient and tower: the variables are named
  by the decision's flags (a NaN or Inf of any tower reaches the average).

  Args:
    grads_and_vars: the (averaged) pairs the step checks.
    tower_grads_and_vars: one list of (gradient, variable) pairs per tower,
      over the same variables (e.g. before averaging).

  Returns:
    (bool tensor [num_towers], the towers' devices).
  """
  checked = {id(v) for g, v in grads_and_vars if g is not None}
  flags, devices = [], []
  for tower in tower_grads_and_vars:
    tower = list(tower)
    flags.append(nonfinite.any_nonfinite(
        [g for g, v in tower if id(v) in checked]))
    devices.append(device_of(tower))
  return tf.stack(flags), devices


def tower_values(grads_and_vars, tower_grads_and_vars):
  """What the criteria see of the towers (`criteria.Context.towers`): each
  tower's global gradient norm (built only if a criterion reads it, over
  the tensors its fused flag reads) and device."""
  checked = {id(v) for g, v in grads_and_vars if g is not None}
  grads = [[g for g, v in tower if id(v) in checked]
           for tower in tower_grads_and_vars]
  return {tower_outliers.NORM: tower_outliers.tower_norms(grads),
          tower_outliers.DEVICE: [device_of(t) for t in tower_grads_and_vars]}


def segment_flags(flags, sizes):
  """Rows of `flags` split by consecutive segments of `sizes`.

  Row i holds the flags of segment i and False elsewhere: the per-device
  rows of a step guarded over several devices' gradients.
  """
  mask = np.zeros([len(sizes), sum(sizes)], bool)
  start = 0
  for i, size in enumerate(sizes):
    mask[i, start:start + size] = True
    start += size
  return tf.logical_and(tf.constant(mask), tf.expand_dims(flags, 0))


class StepReportHook(hooks.GatedHook):
  """Logs the report of every skipped step; checks each new train op.

  With `story` (a `story.WrapperStory`, which `report_hook` sets) it
  also logs the run's start line at `begin` and its final line at `end`.
  """

  story = None

  def __init__(self, report, check_fn=None):
    """Creates the hook.

    Args:
      report: a `StepReport`.
      check_fn: optional `check_fn(ops)`, called once for each distinct set
        of fetched ops that runs the step (e.g. `write_check.check`); it
        may raise to refuse the run before anything runs.
    """
    self._report = report
    self._fetches = report.fetches
    self._check_fn = check_fn
    self.reports = []
    self.dry_run_reports = []

  def check_new_run(self, ops):
    super(StepReportHook, self).check_new_run(ops)
    if self._check_fn is not None:
      self._check_fn(ops)

  def begin(self):
    super(StepReportHook, self).begin()
    if self.story is not None:
      self.story.begin()

  def end(self, session):
    del session  # What the run did was fetched with its steps.
    if self.story is not None:
      self.story.end()

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    if self.story is not None:
      self.story.count(self._report.label(run_values.results))
    for line in self._report.dry_run_lines(run_values.results):
      self.dry_run_reports.append(line)
      logging.warning("%s", line)
    line = self._report.describe(run_values.results)
    if line:
      self.reports.append(line)
      logging.warning("%s", line)
