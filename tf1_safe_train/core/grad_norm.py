"""--skip_grad_norm_above: skip a finite step whose gradient norm exceeds X.

A fixed ceiling on the global gradient norm (the context's one
overflow-safe norm, `criteria.Context.global_norm`); declared in
`grad_norm_spec`.
"""

import tensorflow as tf

from tf1_safe_train.core import criteria


class GradNormAbove(criteria.Criterion):
  """Skips a finite step whose global gradient norm is above `threshold`."""

  reason = "grad_norm"

  def __init__(self, threshold):
    self.threshold = float(threshold)

  def decide(self, context):
    norm = context.global_norm
    threshold = tf.constant(self.threshold)
    # A non-finite step is skipped for that reason, never called this one.
    flag = tf.logical_and(norm > threshold, tf.logical_not(context.nonfinite))
    return flag, {"grad_norm": norm, "threshold": threshold}

  def describe(self, values):
    return "gradient norm %.4g > threshold %.4g" % (values["grad_norm"],
                                                    values["threshold"])

  def record(self, values):
    return {k: float(v) for k, v in values.items()}
