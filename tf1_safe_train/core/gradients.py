"""One function applied to gradients, whatever form each gradient takes.

A gradient is a dense Tensor, an `IndexedSlices` (a sparse update, as from a
gather: only its values are transformed, its indices and dense_shape kept) or
None (the loss does not depend on the variable: it stays None).
"""

import tensorflow as tf


def map_values(fn, grad):
  """`fn` applied to the values of one gradient.

  Args:
    fn: Tensor -> Tensor; called once (not at all for None), where the
      caller's name and device scopes are.
    grad: a Tensor, an `IndexedSlices` or None.

  Returns:
    `fn(grad)`, an `IndexedSlices` with `fn(grad.values)` and `grad`'s
    indices and dense_shape (None or not), or None.
  """
  if grad is None:
    return None
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
  return fn(grad)


def map_gradients(fn, grads_and_vars):
  """(`map_values(fn, gradient)`, variable) for each pair, in order."""
  return [(map_values(fn, g), v) for g, v in grads_and_vars]
