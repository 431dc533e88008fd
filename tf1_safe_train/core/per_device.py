"""One guarded step over several devices' variable copies.

What `SkipNonFiniteOptimizer.apply_gradients_per_device` builds inside its
one decision: each device's update by its own optimizer, and the report's
per-device rows.
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
  """(per-device flag rows, the devices) of the step's report."""
  checked_sizes = [sum(1 for g, _ in group if g is not None)
                   for group in groups]
  return (step_report.segment_flags(result.nonfinite_flags, checked_sizes),
          [step_report.device_of(group) for group in groups])
