"""One guarded step over several devices' variable copies.

`SkipNonFiniteOptimizer.apply_gradients_per_device` (its `PerDeviceSteps`
part) and what it builds inside its one decision: each device's update by
its own optimizer, and the report's per-device rows.
"""

import tensorflow as tf

from tf1_safe_train.core import step_report

tf1 = tf.compat.v1


def check_optimizers(optimizers, num_devices, default):
  """The optimizer of each device (`default` for all if None).

  Raises:
    ValueError: if `optimizers` does not give one optimizer per device.
  """
  if optimizers is None:
    return [default] * num_devices
  optimizers = list(optimizers)
  if len(optimizers) != num_devices or not all(
      isinstance(o, tf1.train.Optimizer) for o in optimizers):
    raise ValueError("apply_gradients_per_device: optimizers must be one "
                     "tf.compat.v1.train.Optimizer per device (%d), got %r"
                     % (num_devices, optimizers))
  return optimizers


def apply_fn(optimizers, groups, name):
  """The guard's `apply_fn`: each device's checked pairs to its optimizer."""
  sizes = [len(g) for g in groups]

  def apply(checked_grads_and_vars):
    updates, start = [], 0
    for i, (opt, size) in enumerate(zip(optimizers, sizes)):
      pairs = checked_grads_and_vars[start:start + size]
      start += size
      if any(g is not None for g, _ in pairs):
        updates.append(opt.apply_gradients(
            pairs, name=("%s_%d" % (name, i)) if name else None))
    return tf.group(*updates)

  return apply


def report_rows(result, groups):
  """(per-device flag rows, the devices) of the step's report.

  (None, None) for one group: one device's copy, e.g. the gradients of all
  towers averaged onto the parameter server's variables, cannot tell which
  tower was non-finite; the report then names the variables only.
  """
  if len(groups) < 2:
    return None, None
  checked_sizes = [sum(1 for g, _ in group if g is not None)
                   for group in groups]
  return (step_report.segment_flags(result.nonfinite_flags, checked_sizes),
          [step_report.variables_device(group) for group in groups])


class PerDeviceSteps(object):
  """`SkipNonFiniteOptimizer.apply_gradients_per_device`."""

  def __init__(self, optimizer, build_step, last_step):
    """Creates the part.

    Args:
      optimizer: the wrapped optimizer (every device's by default).
      build_step: the wrapper's guarded step: `build_step(grads_and_vars,
        global_step, apply_fn, optimizers_and_pairs)` returns its
        `guard.GuardResult`.
      last_step: the wrapper's `reporting.LastStep`, given the report.
    """
    self._optimizer = optimizer
    self._build_step = build_step
    self._last_step = last_step

  def apply_gradients_per_device(self, grads_and_vars_per_device,
                                 global_step=None, name=None, optimizers=None):
    """One step over several devices' variable copies: one decision, one count.

    For scripts that keep a copy of the variables per device and apply each
    device's (all-reduced) gradients to its own copy: calling
    `apply_gradients` once per device would build one step per device, each
    deciding alone and each counted. Here every device's gradients are
    checked together, one `tf.cond` applies all updates or none, and the
    counters move once. Each device's update is built by its own optimizer
    (the wrapped one by default), which places it on its variables' device.

    Args:
      grads_and_vars_per_device: one list of (gradient, variable) pairs per
        device.
      global_step: optional variable, advanced once per step.
      name: optional name for the wrapped optimizers' update ops.
      optimizers: optional `tf.compat.v1.train.Optimizer` per device (e.g.
        one instance per device, as the script had); default: the wrapped
        optimizer for every device.

    Returns:
      The step's train op.

    Raises:
      ValueError: if `optimizers` does not give one optimizer per device.
    """
    groups = [tuple(g) for g in grads_and_vars_per_device]
    optimizers = check_optimizers(optimizers, len(groups), self._optimizer)
    result = self._build_step(
        tuple(pair for group in groups for pair in group), global_step,
        apply_fn(optimizers, groups, name),
        list(zip(optimizers, groups)))
    self._last_step.set_report(result, global_step,
                               *report_rows(result, groups))
    return result.train_op
