"""The global L2 norm of gradients, without overflow in the sum of squares.

One definition for the whole package: the skip criteria read it from their
step's context (`criteria.Context.global_norm`, built once per step, only
if a criterion reads it) and the trainer's clipping shares it
(`trainer/step/optimization.py`).
"""

import tensorflow as tf

from tf1_safe_train.core import nonfinite

tf1 = tf.compat.v1


def scaled_norm(tensors):
  """(scale, n): the global L2 norm of `tensors` is scale * n, n in [1, sqrt(k)].

  For an exact clip (`trainer/optimization.clip_by_global_norm`): the
  gradients are divided by `scale` with no intermediate overflow.

  Squaring the raw values overflows for finite values above about 1.8e19;
  dividing by the largest magnitude first keeps every square <= 1.
  """
  values = [tf.cast(t.values if isinstance(t, tf.IndexedSlices) else t,
                    tf.float32) for t in tensors if t is not None]
  scale = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(v)) for v in values]))
  safe_scale = tf.where(scale > 0, scale, tf.ones_like(scale))
  sum_squares = tf.add_n(
      [tf.reduce_sum(tf.square(v / safe_scale)) for v in values])
  return safe_scale, tf.sqrt(sum_squares)


def global_norm(tensors):
  """The global L2 norm of `tensors`, without overflow in the sum of squares.

  `tf.linalg.global_norm` squares the raw values, so finite float32
  gradients above about 1.8e19 give an infinite norm, and
  `tf.clip_by_global_norm` then turns every gradient into NaN. Here the
  squares are summed in float64, which holds the square of any float32
  (3.4e38 squared is 1.2e77): a cast and an `L2Loss` per tensor, and four
  nodes for the sum (`tf.linalg.global_norm`'s sum takes six). The norm
  itself is Inf only if it exceeds the float32 maximum.

  Args:
    tensors: list of Tensors or IndexedSlices (None entries ignored).

  Returns:
    A float32 scalar tensor.
  """
  with tf1.name_scope("global_norm"):
    half_squares = tf.add_n([
        tf.nn.l2_loss(tf.cast(t.values if isinstance(t, tf.IndexedSlices)
                              else t, tf.float64))
        for t in tensors if t is not None])
    # (x + x, not 2 * x: no constant to run.)
    return tf.cast(tf.sqrt(half_squares + half_squares), tf.float32)


def fused_global_norm(grads):
  """`global_norm` of `grads`, over the tensors their fused non-finite
  check reads (`nonfinite.fused`): a tower's norm beside its check costs a
  few nodes per pass (a cast and an `L2Loss`) and four for the sum,
  however many gradients it has. Built where the gradients are.

  Args:
    grads: list of Tensors or IndexedSlices (None entries ignored).

  Returns:
    A float32 scalar tensor.
  """
  joined = nonfinite.fused(grads)
  if not joined:
    return tf.constant(0.0)
  with joined[0].graph.colocate_with(joined[0].op):
    return global_norm(joined)
