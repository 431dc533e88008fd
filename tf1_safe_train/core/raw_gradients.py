"""The gradients as computed, before the script changed them (e.g. clipping).

`tf.clip_by_global_norm` turns one non-finite gradient into NaN everywhere,
so the decision's flags name every variable. The skip report checks the
gradients before such a change instead, on skipped steps only, to name
where the fault began: those `compute_gradients` returned, or the inputs of
a scale every gradient shares (what `tf.clip_by_global_norm` builds, whether
the script computed the gradients with `compute_gradients` or
`tf.gradients`).
"""

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import nonfinite

tf1 = tf.compat.v1


def _values(grad):
  return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _with_values(grad, values):
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
  return values


def _peel(tensor, types=("Identity", "Cast")):
  while tensor.op.type in types:
    tensor = tensor.op.inputs[0]
  return tensor


def _scaled(tensor):
  """[(x, s)]: the ways `tensor` is x * s (behind Identities), s a scalar."""
  op = _peel(tensor, ("Identity",)).op
  if op.type != "Mul":
    return []
  a, b = op.inputs
  return [(x, _peel(y)) for x, y in ((a, b), (b, a)) if y.shape.rank == 0]


def _computed_from(scale, xs):
  """True if `scale` is computed from every one of `xs` (a global norm)."""
  targets = {x.op for x in xs}
  seen, stack = set(), [scale.op]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    if op not in targets:  # The walk ends at the gradients.
      stack.extend(t.op for t in op.inputs)
  return targets <= seen


def _shared_scale_inputs(grads):
  """{index: x} for the gradients x * s whose scalar s is shared by at
  least two of `grads` and computed from their x's (a global norm): one
  non-finite x makes s, and so all of them, non-finite."""
  users = {}
  for i, g in enumerate(grads):
    for x, scale in _scaled(_values(g)):
      users.setdefault(scale.ref(), []).append((i, x))
  inputs = {}
  for scale, pairs in users.items():
    if len(pairs) > 1 and _computed_from(scale.deref(),
                                         [x for _, x in pairs]):
      for i, x in pairs:
        inputs.setdefault(i, _with_values(grads[i], x))
  return inputs


def before_changes(checked, computed):
  """The checked gradients as computed, or None if none was changed.

  Args:
    checked: the (gradient, variable) pairs the step checks (no None).
    computed: {id(variable): (variable, gradient)} of what
      `compute_gradients` returned.

  Returns:
    A list aligned with `checked`, each the gradient before the script's
    change (or the applied one where none is known), or None.
  """
  grads = [g for g, _ in checked]
  found = [None] * len(checked)
  for i, (g, v) in enumerate(checked):
    var, grad = computed.get(id(v), (None, None))
    if var is v and grad is not g:
      found[i] = grad
  shared = _shared_scale_inputs(grads)
  for i, raw in shared.items():
    if found[i] is None:
      found[i] = raw
  if all(f is None for f in found):
    return None
  return [g if f is None else f for g, f in zip(grads, found)]


def flags(raw_grads, applied):
  """Their non-finite flags, computed on a skipped step only (else False)."""
  return tf.cond(applied,
                 lambda: tf.zeros([len(raw_grads)], tf.bool),
                 lambda: nonfinite.nonfinite_flags(raw_grads),
                 name="raw_gradient_flags")


def describe(names_of, applied_flags, raw_flags):
  """The report's variables: where the fault began, then where it spread.

  Args:
    names_of: `names_of(flags)` -> the flagged variables' names, a string.
    applied_flags: the decision's flags (of the applied gradients).
    raw_flags: the fetched `flags` of the gradients as computed, or None.
  """
  applied_flags = np.asarray(applied_flags, dtype=bool)
  if raw_flags is None:
    return names_of(applied_flags)
  raw_flags = np.asarray(raw_flags, dtype=bool)
  if not raw_flags.any():
    # The change itself made them non-finite: an overflow.
    return names_of(applied_flags) + (
        " (finite as computed, made non-finite after: e.g. "
        "tf.clip_by_global_norm of a norm that overflows)")
  shown = names_of(raw_flags)
  spread = applied_flags & ~raw_flags
  if spread.any():
    shown += ("; spread to %s after the gradients were computed (e.g. by "
              "tf.clip_by_global_norm)" % names_of(spread))
  return shown
