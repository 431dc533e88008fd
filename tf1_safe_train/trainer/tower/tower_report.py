"""What a step that left out towers tells (`--skip_unit=tower`).

One log line per such step, naming each tower left out, its device and why
(non-finite, or an outlier: its statistic against the threshold), and how
many towers the applied average had; TensorBoard gets each tower's
`rejected` count (`step_summaries`), run_summary.json `rejected_by_tower`.
"""

from absl import logging
import numpy as np

from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.core import skip_report
from tf1_safe_train.core import tower_outliers


def describe(step, grad_flags, loss_flags, devices, scale=None,
             num_active=None, outliers=None):
  """The line of an applied step that left out towers, or None if none.

  `num_active`: the towers built (default: every one; the others are
  quarantined). `outliers`: {tower: why} of the towers left out as
  outliers (`tower_outliers.TowerOutliers.tower_words`).

  e.g. "step 78: tower 1 (/device:CPU:1) left out: non-finite gradients;
  applied 3 of 4 towers".
  """
  outliers = outliers or {}
  left = [t for t, (g, l) in enumerate(zip(grad_flags, loss_flags))
          if g or l or t in outliers]
  if not left:
    return None
  parts = []
  for t in left:
    why = ("non-finite gradients" if grad_flags[t] else "non-finite loss")
    if grad_flags[t] and loss_flags[t]:
      why = "non-finite loss and gradients"
    if not (grad_flags[t] or loss_flags[t]):
      why = "outlier, " + outliers[t]
    parts.append("tower %d (%s) left out: %s" % (t, devices[t], why))
  active = num_active or len(devices)
  line = "step %d: %s; applied %d of %d towers" % (
      step, "; ".join(parts), active - len(left), active)
  if scale is not None and any(grad_flags[t] or loss_flags[t] for t in left):
    line += ("; loss scale %s halves (as on an overflow)"
             % skip_report.format_scale(scale))
  return line


def describe_too_few(step, num_healthy, num_active, min_healthy):
  """The line of a step skipped whole for too few healthy towers."""
  return ("step %d: %d of %d towers healthy, fewer than "
          "--min_healthy_towers=%d: the whole step is skipped"
          % (step, num_healthy, num_active, min_healthy))


class LeftOutHook(core_hooks.GatedHook):
  """On every applied step that left out towers, logs `describe`'s line."""

  def __init__(self, step):
    """Creates the hook.

    Args:
      step: the run's `train_step.Step`, with a `tower_unit`.
    """
    unit = step.tower_unit
    self._fetches = {"step": step.step_index, "applied": step.applied,
                     "grads": unit.grad_flags, "loss": unit.loss_flags,
                     "too_few": unit.skip, "healthy": unit.num_healthy}
    if step.loss_scale_before is not None:
      self._fetches["scale"] = step.loss_scale_before
    self._outliers = None
    if unit.outliers is not None:  # --skip_tower_outliers: its words.
      self._outliers = step.reasons.criterion(tower_outliers.REASON)
      self._fetches["outliers"] = unit.outliers
      self._fetches["values"] = step.reasons.fetches["values"][
          tower_outliers.REASON]
    self._devices = list(step.report.tower_devices)
    self._num_active = unit.num_active
    self._min_healthy = unit.min_healthy
    self.last_line = None

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    results = run_values.results
    if not results["applied"]:
      if results["too_few"]:  # (The skip report names the towers.)
        logging.warning("%s", describe_too_few(
            int(results["step"]), int(results["healthy"]), self._num_active,
            self._min_healthy))
      return
    line = describe(int(results["step"]), np.reshape(results["grads"], [-1]),
                    np.reshape(results["loss"], [-1]), self._devices,
                    results.get("scale"), self._num_active,
                    self._outlier_words(results))
    if line:
      self.last_line = line
      logging.warning("%s", line)

  def _outlier_words(self, results):
    """{tower: why} of the towers left out as outliers."""
    if self._outliers is None:
      return None
    return self._outliers.outlier_words(results["values"])
