"""SessionRunHooks: progress, skip report, give-up, the last step.

(Signals: see stop_signals.py.)

Every value a hook reports is read after the step's update (the counters come
from `counters.read_after`, the applied flag from the decision itself), never
from a raw variable read that is unordered relative to the update. Such reads
run the train op, so a hook fetches them only on runs that run it anyway
(`fetch_gate`): `sess.run(loss, {x: validation_batch})` never trains.
"""

import time

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train import fetch_gate
from tf1_safe_train import write_check

tf1 = tf.compat.v1


class GatedHook(tf1.train.SessionRunHook):
  """A hook whose fetches are added only to runs that run their effects.

  Subclasses set `self._fetches` and handle `after_run` only when
  `self._fetched` (True when this run carried the hook's fetches). A run
  that executes two steps built by `SkipNonFiniteOptimizer` (which would
  count one step twice) is refused before it runs.
  """

  _fetches = None
  _gate = None
  _fetched = False

  def begin(self):
    # A new session may come with a new graph: what was learned of the old
    # one's fetches does not hold.
    self._gate = None

  def check_new_run(self, ops):
    """Called before the first run of each distinct set of fetched `ops`."""
    write_check.check_one_step(ops)

  def before_run(self, run_context):
    if self._gate is None:
      self._gate = fetch_gate.FetchGate(self._fetches, self.check_new_run)
    self._fetched = self._gate.allows(run_context)
    if not self._fetched:
      return None
    return tf1.train.SessionRunArgs(self._fetches)


class ProgressHook(GatedHook):
  """Logs step, loss, learning rate, examples/s, applied and skipped."""

  def __init__(self, step_index, loss, learning_rate, counters,
               examples_per_step, every_n_steps, summary_dir=None,
               loss_scale=None):
    """Creates the hook.

    Args:
      step_index: int scalar tensor, global_step at the start of the step.
      loss: float scalar tensor, the step's mean loss over towers.
      learning_rate: float scalar tensor.
      counters: `SkipCounters` of tensors read after the step.
      examples_per_step: examples consumed by one step (all towers).
      every_n_steps: log every this many steps.
      summary_dir: if set, also write an `examples_per_sec` summary there.
      loss_scale: optional float scalar tensor (the loss scale after the
        step), shown in the line.
    """
    self._fetches = {"step": step_index, "loss": loss, "lr": learning_rate,
                     "counters": counters}
    if loss_scale is not None:
      self._fetches["loss_scale"] = loss_scale
    self._examples_per_step = examples_per_step
    self._every_n = every_n_steps
    self._summary_dir = summary_dir
    self._last_time = None
    self._last_step = None
    self.examples_per_sec = None

  def begin(self):
    super(ProgressHook, self).begin()
    self._last_time = None

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    results = run_values.results
    step = int(results["step"])
    now = time.time()
    if self._last_time is None:
      # The first step includes graph optimisation: do not time it.
      self._last_time, self._last_step = now, step
      return
    if (step + 1) % self._every_n:
      return
    steps = step - self._last_step
    if steps > 0:
      self.examples_per_sec = (steps * self._examples_per_step /
                               max(now - self._last_time, 1e-9))
    self._last_time, self._last_step = now, step
    counters = results["counters"]
    logging.info(
        "step %d  loss %.4f  lr %.4g  %s examples/s  applied %d  skipped %d%s",
        step + 1, results["loss"], results["lr"],
        "%.1f" % self.examples_per_sec if self.examples_per_sec else "-",
        counters.applied_steps, counters.skipped_steps,
        "  loss scale %s" % format_scale(results["loss_scale"])
        if "loss_scale" in results else "")
    if self._summary_dir and self.examples_per_sec:
      writer = tf1.summary.FileWriterCache.get(self._summary_dir)
      writer.add_summary(
          tf1.Summary(value=[tf1.Summary.Value(
              tag="examples_per_sec", simple_value=self.examples_per_sec)]),
          step + 1)


def format_scale(scale):
  """A loss scale as printed: whole numbers in full (1048576, not 1.04858e+06)."""
  scale = float(scale)
  if scale.is_integer() and abs(scale) < 2.0**53:
    return "%d" % scale
  return "%g" % scale


def describe_skip(step, tower_flags, average_flags, variable_names,
                  tower_devices, max_names=5):
  """Returns the one-line report of a skipped step.

  Args:
    step: the step index (global_step at its start).
    tower_flags: bool array [num_towers, num_variables], per-tower non-finite
      gradient flags, or [num_towers], one fused flag per tower (the
      trainer's: the variables are then named by `average_flags` alone, as
      a non-finite value of any tower survives averaging).
    average_flags: bool array [num_variables], flags of the averaged gradients.
    variable_names: names aligned with the flags' last axis.
    tower_devices: device string of each tower ("" if unknown: not shown).
    max_names: how many variable names to list before "+N more".

  Returns:
    A string.
  """
  tower_flags = np.asarray(tower_flags, dtype=bool)
  by_variable = np.asarray(average_flags, dtype=bool)
  if tower_flags.ndim != 1:
    tower_flags = tower_flags.reshape(len(tower_devices), -1)
    by_variable = tower_flags.any(axis=0) | by_variable
  tower_flags = tower_flags.reshape(len(tower_devices), -1)
  bad_towers = [i for i in range(len(tower_devices)) if tower_flags[i].any()]
  names = [n for n, bad in zip(variable_names, by_variable) if bad]
  shown = ", ".join(names[:max_names])
  if len(names) > max_names:
    shown += ", ... (+%d more, %d in all)" % (len(names) - max_names,
                                             len(names))
  if bad_towers:
    where = "in tower%s %s" % (
        "s" if len(bad_towers) > 1 else "",
        ", ".join("%d (%s)" % (i, tower_devices[i]) if tower_devices[i]
                  else "%d" % i for i in bad_towers))
  else:
    where = "in the averaged gradients (every tower was finite: overflow)"
  return "skipped step %d: non-finite gradients %s; variables: %s" % (
      step, where, shown or "-")


class SkipReportHook(GatedHook):
  """On every skipped step, logs where the non-finite gradients were."""

  def __init__(self, step_index, applied, tower_flags, average_flags,
               variable_names, tower_devices, loss_scale=None,
               loss_scale_floor=1.0):
    """Creates the hook.

    Args:
      step_index: int scalar tensor, global_step at the start of the step.
      applied: bool scalar tensor from the decision.
      tower_flags: bool tensor [num_towers, num_variables] or [num_towers]
        (see `describe_skip`).
      average_flags: bool tensor [num_variables].
      variable_names: Python list aligned with the flags.
      tower_devices: Python list of each tower's device string.
      loss_scale: optional float scalar tensor, the loss scale the step ran
        with: a skip above `loss_scale_floor` is reported as an expected
        loss-scale overflow, one at the floor as a real fault.
      loss_scale_floor: the loss scale's floor.
    """
    self._fetches = {"step": step_index, "applied": applied,
                     "towers": tower_flags, "average": average_flags}
    if loss_scale is not None:
      self._fetches["loss_scale"] = loss_scale
    self._floor = loss_scale_floor
    self._variable_names = list(variable_names)
    self._tower_devices = list(tower_devices)

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    results = run_values.results
    if results["applied"]:
      return
    report = describe_skip(int(results["step"]), results["towers"],
                           results["average"], self._variable_names,
                           self._tower_devices)
    if "loss_scale" in results:
      scale = float(results["loss_scale"])
      if scale > self._floor:
        report += ("; loss-scale overflow at scale %s (expected: the scale "
                   "halves)" % format_scale(scale))
      else:
        report += ("; at the floor loss scale %s: a real fault (counts "
                   "toward --max_consecutive_skips)" % format_scale(scale))
    logging.warning("%s", report)


class GiveUpHook(GatedHook):
  """Stops the run after `max_consecutive_skips` skipped steps in a row.

  It requests a stop rather than raising, so the session closes normally and
  the final checkpoint is written: skipped steps change nothing of the model,
  so that checkpoint holds the last good state. `gave_up` tells the caller.
  """

  def __init__(self, consecutive_skips, max_consecutive_skips):
    """Creates the hook.

    Args:
      consecutive_skips: int tensor read after the step.
      max_consecutive_skips: give up when this many steps in a row were
        skipped; 0 never gives up.
    """
    self._fetches = consecutive_skips
    self._max = max_consecutive_skips
    self.gave_up = False

  def after_run(self, run_context, run_values):
    if self._fetched and self._max and run_values.results >= self._max:
      self.gave_up = True
      logging.error("giving up: %d consecutive steps skipped "
                    "(--max_consecutive_skips=%d)", run_values.results,
                    self._max)
      run_context.request_stop()


class StopAtStepHook(tf1.train.StopAtStepHook):
  """`tf1.train.StopAtStepHook(last_step=...)` that never runs past it.

  TensorFlow's hook decides only after a step, so a session restored at or
  beyond `last_step` (re-running a finished --train_dir, or resuming after a
  crash that followed the final checkpoint) would run one more step each
  time. This one also checks the restored step when the session is created
  and then stops before the first step.
  """

  def __init__(self, last_step):
    # Keyword: TensorFlow's first positional argument is num_steps.
    super().__init__(last_step=last_step)

  def after_create_session(self, session, coord):
    super().after_create_session(session, coord)
    step = session.run(self._global_step_tensor)
    if step >= self._last_step:
      logging.info("global_step %d is already at --max_steps=%d: no step to "
                   "run", step, self._last_step)
      coord.request_stop()


class RunStatsHook(GatedHook):
  """Keeps the latest values `run_summary.json` reports."""

  def __init__(self, fetches):
    """Creates the hook.

    Args:
      fetches: dict of tensors to fetch every step; the latest values are in
        `latest` after each step.
    """
    self._fetches = fetches
    self.latest = None
    self.steps_run = 0

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    self.latest = run_values.results
    self.steps_run += 1
