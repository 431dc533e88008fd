"""Optimisation settings: optimizer, learning-rate schedule, gradient clipping.

The schedule reads a step tensor chosen by the caller (by default the trainer
passes `applied_steps`, so a skipped step does not decay the rate). Clipping
runs after the finiteness check, inside the apply branch, and computes the
global norm in a way that cannot overflow for finite gradients (`norms`).
"""

import math

import tensorflow as tf

from tf1_safe_train.core import gradients
from tf1_safe_train.core import norms

tf1 = tf.compat.v1


def make_optimizer(name, learning_rate):
  """Returns the `tf.compat.v1.train.Optimizer` called `name`.

  Args:
    name: 'momentum' (0.9), 'sgd', 'adam' or 'rmsprop' (decay 0.9, momentum
      0.9, epsilon 1.0 as in tf_cnn_benchmarks).
    learning_rate: float or scalar tensor.

  Raises:
    ValueError: for an unknown name.
  """
  if name == "momentum":
    return tf1.train.MomentumOptimizer(learning_rate, momentum=0.9)
  if name == "sgd":
    return tf1.train.GradientDescentOptimizer(learning_rate)
  if name == "adam":
    return tf1.train.AdamOptimizer(learning_rate)
  if name == "rmsprop":
    return tf1.train.RMSPropOptimizer(
        learning_rate, decay=0.9, momentum=0.9, epsilon=1.0)
  raise ValueError("unknown optimizer %r" % (name,))


def learning_rate(schedule, base_rate, step, total_steps):
  """Returns the learning rate at `step` as a float32 scalar tensor.

  Args:
    schedule: 'constant'; 'piecewise' (x0.1 at 50% and again at 75% of
      `total_steps`); or 'cosine' (from `base_rate` to 0 over `total_steps`).
    base_rate: the initial learning rate.
    step: int scalar tensor driving the schedule.
    total_steps: the run's length in steps (`max_steps`).

  Raises:
    ValueError: for an unknown schedule.
  """
  with tf1.name_scope("lr_schedule"):
    step = tf.cast(step, tf.float32)
    if schedule == "constant":
      return tf.constant(base_rate, dtype=tf.float32)
    if schedule == "piecewise":
      boundaries = [int(total_steps * 0.5), int(total_steps * 0.75)]
      rates = [base_rate, base_rate * 0.1, base_rate * 0.01]
      return tf1.train.piecewise_constant(
          step, [float(b) for b in boundaries], rates)
    if schedule == "cosine":
      progress = tf.minimum(step / float(max(total_steps, 1)), 1.0)
      return base_rate * 0.5 * (1.0 + tf.cos(math.pi * progress))
  raise ValueError("unknown learning-rate schedule %r" % (schedule,))


# Kept importable from here (the trainer's clipping shares it).
global_norm = norms.global_norm


def clip_by_global_norm(grads_and_vars, clip_norm):
  """Scales all gradients so that their global norm is at most `clip_norm`.

  Exact for any finite gradients, even when their norm exceeds the float32
  maximum: an over-long gradient g becomes (g / s) * (clip_norm / n), where
  s * n is the norm, so no intermediate value overflows or underflows to 0
  (a clipped step that zeroed the gradients would still move momentum and
  Adam). Gradients within the norm pass through unchanged, bit for bit.

  Args:
    grads_and_vars: list of (gradient, variable); all gradients finite.
    clip_norm: positive float.

  Returns:
    (clipped grads_and_vars, the global norm before clipping, Inf if beyond
    the float32 maximum).
  """
  grads = [g for g, _ in grads_and_vars]
  with tf1.name_scope("clip_by_global_norm"):
    scale, scaled_norm = norms.scaled_norm(grads)
    norm = scale * scaled_norm
    # Compared in the scaled space: norm > clip_norm even when norm is Inf.
    over = scaled_norm > clip_norm / scale
    one = tf.ones_like(scale)
    divisor = tf.where(over, scale, one)
    multiplier = tf.where(over, clip_norm / scaled_norm, one)

    def clip(values):
      return ((values / tf.cast(divisor, values.dtype)) *
              tf.cast(multiplier, values.dtype))

    clipped = gradients.map_gradients(clip, grads_and_vars)
  return clipped, norm


def weight_decay_loss(rate):
  """`rate` times the L2 loss of the weights (variables named "*weights").

  None when `rate` is 0 or the model has no such variable.
  """
  weights = [v for v in tf1.trainable_variables()
             if v.op.name.endswith("weights")]
  if not rate or not weights:
    return None
  with tf1.name_scope("weight_decay"):
    return rate * tf.add_n([tf.nn.l2_loss(w) for w in weights])
