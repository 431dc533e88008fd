"""The trainer's SessionRunHooks: progress, skip report, the last step, stats.

(The gated base and `GiveUpHook`, which a wrapper user needs too, are in
core/hooks.py; signals in stop_signals.py.) As there, every value is read
after the step's update and fetched only on runs that run the train op.
"""

import collections
import time

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.core import reasons as reasons_lib
from tf1_safe_train.core import skip_report

tf1 = tf.compat.v1


# The ETA follows the rate of this many recent progress intervals: recent
# enough to follow a change of pace, long enough that one slow interval (a
# checkpoint, a skip explained) does not swing it.
_ETA_INTERVALS = 5


def format_eta(seconds):
  """`seconds` as H:MM:SS, or "-" if not known (None)."""
  if seconds is None:
    return "-"
  minutes, secs = divmod(int(round(max(seconds, 0.0))), 60)
  return "%d:%02d:%02d" % (minutes // 60, minutes % 60, secs)


class ProgressHook(core_hooks.GatedHook):
  """Logs step (of max_steps), loss, lr, examples/s, applied, skipped, ETA."""

  def __init__(self, step_index, loss, learning_rate, counters,
               examples_per_step, every_n_steps, summary_dir=None,
               loss_scale=None, skip_reasons=None, max_steps=None):
    """Creates the hook.

    Args:
      step_index: int scalar tensor, global_step at the start of the step.
      loss: float scalar tensor, the step's mean loss over towers.
      learning_rate: float scalar tensor.
      counters: `SkipCounters` of tensors read after the step.
      examples_per_step: examples consumed by one step (all towers).
      every_n_steps: log after each step whose index is a multiple of
        this (the line names the index, as a skip's line does, and counts
        that step), and after the run's last (index max_steps - 1).
      summary_dir: if set, also write an `examples_per_sec` summary there.
      loss_scale: optional float scalar tensor (the loss scale after the
        step), shown in the line.
      skip_reasons: optional dict of the reasons' counters read after the
        step (`reasons.Report.counts`): the line says how many skips (and
        dry-run would-be skips) each reason other than non-finite had.
      max_steps: the global_step the run ends at, or None (open-ended): the
        line then says `step N/max_steps` and the time left at the pace of
        the last few lines (global steps per second, so other workers'
        steps count too), `ETA -` while global_step has not moved.
    """
    self._fetches = {"step": step_index, "loss": loss, "lr": learning_rate,
                     "counters": counters}
    if loss_scale is not None:
      self._fetches["loss_scale"] = loss_scale
    if skip_reasons is not None:
      self._fetches["skip_reasons"] = skip_reasons
    self._examples_per_step = examples_per_step
    self._every_n = every_n_steps
    self._summary_dir = summary_dir
    self._max_steps = max_steps
    self._last_time = None
    self._last_step = None
    self._marks = collections.deque(maxlen=_ETA_INTERVALS + 1)
    self.examples_per_sec = None

  def begin(self):
    super(ProgressHook, self).begin()
    self._last_time = None
    self._marks.clear()

  def _eta(self):
    """Seconds left at the pace from the oldest mark to the newest, or None."""
    (then, steps_then), (now, steps_done) = self._marks[0], self._marks[-1]
    if steps_done <= steps_then or now <= then:
      return None
    rate = (steps_done - steps_then) / (now - then)
    return max(self._max_steps - steps_done, 0) / rate

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    results = run_values.results
    step = int(results["step"])
    now = time.time()
    if self._last_time is None:
      # The first step includes graph optimisation: do not time it.
      self._last_time, self._last_step = now, step
      self._marks.append((now, step + 1))
      return
    # Named by the step's index (global_step at its start), as a skip's
    # line names it, and logged after it: its counts include its own skip.
    last = self._max_steps and step + 1 >= self._max_steps
    if step % self._every_n and not last:
      return
    steps = step - self._last_step
    if steps > 0:
      self.examples_per_sec = (steps * self._examples_per_step /
                               max(now - self._last_time, 1e-9))
    self._last_time, self._last_step = now, step
    counters = results["counters"]
    spikes = skip_report.progress_words(results.get("skip_reasons") or {})
    self._marks.append((now, step + 1))
    progress, eta = "%d" % step, ""
    if self._max_steps:
      progress += "/%d" % self._max_steps
      eta = "  ETA " + format_eta(self._eta())
    logging.info(
        "step %s  loss %.4f  lr %.4g  %s examples/s  applied %d  skipped %d"
        "%s%s%s",
        progress, results["loss"], results["lr"],
        "%.1f" % self.examples_per_sec if self.examples_per_sec else "-",
        counters.applied_steps, counters.skipped_steps, spikes,
        "  loss scale %s" % skip_report.format_scale(results["loss_scale"])
        if "loss_scale" in results else "", eta)
    if self._summary_dir and self.examples_per_sec:
      writer = tf1.summary.FileWriterCache.get(self._summary_dir)
      writer.add_summary(
          tf1.Summary(value=[tf1.Summary.Value(
              tag="examples_per_sec", simple_value=self.examples_per_sec)]),
          step + 1)


class SkipReportHook(core_hooks.GatedHook):
  """On every skipped step, logs where the non-finite gradients were."""

  def __init__(self, step_index, applied, tower_flags, average_flags,
               variable_names, tower_devices, loss_scale=None,
               loss_scale_floor=1.0, reasons=None, left_out_worker=None):
    """Creates the hook.

    Args:
      step_index: int scalar tensor, global_step at the start of the step.
      applied: bool scalar tensor from the decision.
      tower_flags: bool tensor [num_towers, num_variables] or [num_towers]
        (see `skip_report.nonfinite_words`).
      average_flags: bool tensor [num_variables].
      variable_names: Python list aligned with the flags.
      tower_devices: Python list of each tower's device string.
      loss_scale: optional float scalar tensor, the loss scale the step ran
        with: a skip above `loss_scale_floor` is reported as an expected
        loss-scale overflow, one at the floor as a real fault.
      loss_scale_floor: the loss scale's floor.
      reasons: optional `reasons.Report` of the decision: a skip for
        another reason than non-finite (a spike) is reported with its
        values and thresholds (and the towers --skip_unit=tower left out
        for a NaN/Inf, if any), a dry run's would-be skip too.
      left_out_worker: this worker's index with --skip_unit=worker (a
        sync worker whose own contribution was not finite is left out of
        the step, which the others apply), else None.
    """
    self._left_out_worker = left_out_worker
    self._fetches = {"step": step_index, "applied": applied,
                     "towers": tower_flags, "average": average_flags}
    if loss_scale is not None:
      self._fetches["loss_scale"] = loss_scale
    self._reasons = reasons
    if reasons is not None:
      self._fetches["criteria"] = reasons.fetches
    self._floor = loss_scale_floor
    self._variable_names = list(variable_names)
    self._tower_devices = list(tower_devices)

  @classmethod
  def of_step(cls, step):
    """The hook of a `train_step.Step`."""
    report = step.report
    return cls(step.step_index, step.applied, report.tower_flags,
               report.average_flags, report.variable_names,
               report.tower_devices, loss_scale=step.loss_scale_before,
               reasons=step.reasons, left_out_worker=(
                   step.worker_unit.worker_index if step.worker_unit
                   else None))

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    results = run_values.results
    step = int(results["step"])
    criteria = results.get("criteria")
    if results["applied"]:
      for line in (skip_report.dry_run_lines(self._reasons, step, criteria)
                   if self._reasons else []):
        logging.warning("%s", line)
      return
    reason = (self._reasons.label(criteria) if self._reasons
              else reasons_lib.NONFINITE)
    towers = np.asarray(results["towers"], bool)
    # A finite criterion's skip names the towers --skip_unit=tower left out
    # for a NaN/Inf in that step, if any (both reasons).
    words = (skip_report.nonfinite_words(
        towers, results["average"], self._variable_names,
        self._tower_devices)
             if reason == reasons_lib.NONFINITE or towers.any() else None)
    if self._left_out_worker is not None:
      logging.warning("%s", skip_report.left_out_worker_line(
          self._left_out_worker, step, words))
      return
    suffixes = ([skip_report.loss_scale_words(results["loss_scale"],
                                              self._floor)]
                if "loss_scale" in results else [])
    logging.warning("%s", skip_report.line(step, reason, self._reasons,
                                           criteria, words, suffixes))


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


class RunStatsHook(core_hooks.GatedHook):
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
