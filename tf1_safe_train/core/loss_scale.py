"""Dynamic loss scaling that shares the guard's single apply/skip decision.

float16 gradients underflow unless the loss is scaled up before
differentiation; too large a scale overflows them into Inf. The scale is a
checkpointed variable: a skipped step halves it (down to a floor of 1), and
`growth_steps` applied steps in a row double it. Skips at the floor scale are
real faults, counted apart from expected overflows. With a `hysteresis` of N
only the N-th overflowing step in a row (and each one after it) halves the
scale: one overflow in a long run does not cost precision.
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import criteria
from tf1_safe_train.core import gradients

tf1 = tf.compat.v1

# The largest power of two float32 holds: the scale never grows past it, and
# a larger one would be Inf (every step non-finite, and half of Inf is Inf).
MAX_SCALE = 2.0**127

LossScaleState = collections.namedtuple(
    "LossScaleState", ["scale", "good_steps", "floor_skips"])
LossScaleState.__doc__ = """Loss-scale variables (or tensors read after a step).

Attributes:
  scale: float32, the current loss scale.
  good_steps: int64, applied steps since the scale last changed.
  floor_skips: int64, skipped steps in a row taken at the floor scale (real
    faults, not overflows); reset by an applied step.
"""


class DynamicLossScale(object):
  """A dynamic loss scale whose updates live in the guard's branches.

  Use: scale the loss by `scale()` before computing gradients, pass the
  gradients through `unscale()`, and give this object to
  `guard.guarded_apply(..., branch_ops=[loss_scale])`, which calls
  `on_apply()` inside its apply branch and `on_skip()` inside its skip branch.
  """

  def __init__(self, initial_scale=2.0**15, growth_steps=2000, floor=1.0,
               hysteresis=1, name="loss_scale"):
    """Creates the scale's variables (once per name in a graph).

    Args:
      initial_scale: the starting scale (a power of two keeps the scaling
        exact).
      growth_steps: double the scale after this many applied steps in a row.
      floor: the smallest scale; skips at this scale are real faults.
      hysteresis: halve the scale only on the hysteresis-th overflowing
        (skipped) step in a row and on each one after it; an applied step
        ends the streak. 1 (default): every skip halves it. Above 1 the
        streak is a checkpointed variable, `<name>/overflow_streak`
        (`criteria.OPTIONAL_STATE`: a checkpoint without it restores, the
        streak starting at 0); at 1 there is none.
      name: variable name scope.

    Raises:
      ValueError: for a non-positive scale, floor, growth_steps or
        hysteresis, or an initial scale below the floor.
    """
    if (not floor > 0 or not initial_scale >= floor or
        not initial_scale <= MAX_SCALE):
      raise ValueError("loss scale: need 0 < floor <= initial_scale <= 2**127 "
                       "(float32), got floor=%r initial_scale=%r" %
                       (floor, initial_scale))
    if int(growth_steps) != growth_steps or growth_steps < 1:
      raise ValueError("loss scale: growth_steps must be an integer >= 1, got "
                       "%r" % (growth_steps,))
    if int(hysteresis) != hysteresis or hysteresis < 1:
      raise ValueError("loss scale: hysteresis must be an integer >= 1, got "
                       "%r" % (hysteresis,))
    self._growth_steps = int(growth_steps)
    self._hysteresis = int(hysteresis)
    self._floor = float(floor)
    self._initial_scale = float(initial_scale)
    with tf1.init_scope(), tf1.variable_scope(name, reuse=tf1.AUTO_REUSE):
      self._state = LossScaleState(
          scale=tf1.get_variable(
              "scale", initializer=tf.constant(self._initial_scale),
              trainable=False, use_resource=True),
          good_steps=tf1.get_variable(
              "good_steps", initializer=tf.constant(0, tf.int64),
              trainable=False, use_resource=True),
          floor_skips=tf1.get_variable(
              "floor_skips", initializer=tf.constant(0, tf.int64),
              trainable=False, use_resource=True))
      # None at hysteresis 1: that graph, its checkpoints and its cost per
      # step are those of a scale without hysteresis.
      self._overflow_streak = None
      if self._hysteresis > 1:
        self._overflow_streak = tf1.get_variable(
            "overflow_streak", initializer=tf.constant(0, tf.int64),
            trainable=False, use_resource=True,
            collections=[tf1.GraphKeys.GLOBAL_VARIABLES,
                         criteria.OPTIONAL_STATE])

  @property
  def variables(self):
    """The `LossScaleState` of the scale's variables (not the streak)."""
    return self._state

  @property
  def all_variables(self):
    """Every variable of the scale: `variables`, then the streak if any."""
    return list(self._state) + [v for v in [self._overflow_streak]
                                if v is not None]

  @property
  def hysteresis(self):
    return self._hysteresis

  @property
  def overflow_streak(self):
    """int64 variable: overflowing steps in a row, at most `hysteresis`
    (None at hysteresis 1)."""
    return self._overflow_streak

  @property
  def floor(self):
    return self._floor

  @property
  def initial_scale(self):
    """The scale a fresh run starts at (a float)."""
    return self._initial_scale

  def scale(self):
    """The current scale (a float32 tensor) to multiply the loss by."""
    return self._state.scale.read_value()

  def unscale(self, grads_and_vars, scale=None):
    """Divides each gradient by the scale, keeping the gradient's dtype.

    The division happens in float32 (float64 for float64 gradients) and the
    result is cast back, so each gradient still matches its variable's dtype
    (a float32 gradient against a float16 variable aborts the process in
    TensorFlow's kernels). It divides rather than multiplying by `1 / scale`:
    above 2**126 the inverse is a float32 subnormal, which TensorFlow flushes
    to zero, and every gradient would become 0.

    Args:
      grads_and_vars: (gradient, variable) pairs computed from the scaled loss.
      scale: the scale tensor the loss was multiplied by (default: a fresh
        read; pass the same tensor used for the loss so both agree).

    Returns:
      (gradient, variable) pairs with the gradients divided by the scale.
    """
    scale = self.scale() if scale is None else scale

    def _divide(values):
      wide = tf.float64 if values.dtype == tf.float64 else tf.float32
      quotient = tf.cast(values, wide) / tf.cast(scale, wide)
      return tf.cast(quotient, values.dtype)

    return gradients.map_gradients(_divide, grads_and_vars)

  def on_apply(self):
    """Op for the apply branch: count a good step, grow the scale if due.

    The scale never grows past `MAX_SCALE` (2**127, float32's largest power
    of two).
    """
    s = self._state
    scale = s.scale.read_value()
    good = s.good_steps.read_value() + 1
    grow = good >= self._growth_steps
    # Capped, not merely kept finite: a scale that is not a power of two
    # would otherwise double past 2**127 up to float32's max.
    grown = tf.minimum(scale * 2.0, MAX_SCALE)
    updates = [
        tf1.assign(s.scale, tf.where(grow, grown, scale)),
        tf1.assign(s.good_steps, tf.where(grow, tf.zeros_like(good), good)),
        tf1.assign(s.floor_skips, tf.constant(0, tf.int64))]
    if self._overflow_streak is not None:  # An applied step ends a streak.
      updates.append(tf1.assign(self._overflow_streak,
                                tf.constant(0, tf.int64)))
    return tf.group(*updates, name="loss_scale_on_apply")

  def on_skip(self):
    """Op for the skip branch: halve the scale (floor), count floor skips.

    With hysteresis N the scale halves only when this skip makes N (or more)
    in a row; the streak is kept at N, so each later overflow in the same
    streak halves it again (as DeepSpeed and Megatron-LM do once their
    hysteresis is used up). Any skip resets the count of applied steps
    toward growth.
    """
    s = self._state
    scale = s.scale.read_value()
    at_floor = scale <= self._floor
    # An infinite scale (only from an old checkpoint) restarts at the top.
    halved = tf.maximum(
        tf.where(tf.math.is_finite(scale), scale * 0.5,
                 tf.constant(MAX_SCALE, scale.dtype)), self._floor)
    new_scale, streak_update = halved, []
    if self._overflow_streak is not None:
      streak = tf.minimum(self._overflow_streak.read_value() + 1,
                          self._hysteresis)
      new_scale = tf.where(streak >= self._hysteresis, halved, scale)
      streak_update = [tf1.assign(self._overflow_streak, streak)]
    return tf.group(
        tf1.assign(s.scale, new_scale),
        tf1.assign(s.good_steps, tf.constant(0, tf.int64)),
        tf1.assign_add(s.floor_skips, tf.cast(at_floor, tf.int64)),
        *streak_update, name="loss_scale_on_skip")

  def read_after(self, op):
    """The state read after `op` (e.g. the train op), for hooks."""
    with tf1.control_dependencies([op]):
      return LossScaleState(*[tf.identity(v.read_value()) for v in self._state])

  def gradients(self, compute_gradients, loss, scale=None, **kwargs):
    """Scale, differentiate, unscale: the one place both steps do it.

    Args:
      compute_gradients: an optimizer's `compute_gradients`.
      loss: the loss tensor.
      scale: the scale tensor read for this step (default: a fresh read).
      **kwargs: for `compute_gradients`.

    Returns:
      (gradient, variable) pairs of `loss`, as `unscale` returns them.
    """
    scale = self.scale() if scale is None else scale
    grads_and_vars = compute_gradients(loss * tf.cast(scale, loss.dtype),
                                       **kwargs)
    return self.unscale(grads_and_vars, scale)
