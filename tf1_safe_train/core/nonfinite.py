"""Exact finiteness checks of gradients and written variables.

A value is non-finite if any element is NaN, +Inf or -Inf: tested element by
element (`tf.math.is_finite`), never through a sum or norm that could
overflow on large finite values. The decision (`guard`) and the reports use
these checks.
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import rollback

tf1 = tf.compat.v1


def _values(grad):
  if isinstance(grad, tf.IndexedSlices):
    return grad.values
  return grad


def _check(values):
  """Builds the exact test of `values`, on their device (see is_nonfinite)."""
  with values.graph.colocate_with(values.op), tf1.name_scope("is_nonfinite"):
    return tf.logical_not(tf.reduce_all(tf.math.is_finite(values)))


def is_nonfinite(grad):
  """Returns a bool scalar: True if `grad` holds any NaN, +Inf or -Inf.

  The test is exact, element by element (`tf.math.is_finite`), and never a sum
  or norm of the raw values, which would overflow into a false positive for
  large finite gradients. It runs on the gradient's own device.

  A tensor is checked once per graph: asking again for the same tensor
  (outside control flow) returns the same flag, so a report's per-tower
  flags and a decision's flags share their ops when both see one tower's
  gradients (the check is a pass over every gradient; bench/guard_overhead.py
  measures it). The check reads nothing but `grad`, so it is built free of
  the caller's control dependencies.

  Args:
    grad: a float Tensor (float16, bfloat16, float32, float64) or an
      `IndexedSlices`, whose `.values` are checked.

  Returns:
    A bool scalar tensor.
  """
  values = _values(grad)
  graph = values.graph
  # pylint: disable=protected-access
  in_control_flow = graph._get_control_flow_context() is not None
  # pylint: enable=protected-access
  if (graph is not tf1.get_default_graph() or graph.building_function or
      in_control_flow):
    # Inside a cond, a loop or a function a flag belongs to that context.
    return _check(values)
  checks = getattr(graph, _CHECKS_ATTRIBUTE, None)
  if checks is None:
    checks = {}
    setattr(graph, _CHECKS_ATTRIBUTE, checks)
  flag = checks.get(values.ref())
  if flag is None:
    with tf1.control_dependencies(None):
      flag = _check(values)
    checks[values.ref()] = flag
  return flag


# Flags already built in a graph, by checked tensor. An attribute of the graph
# (not a module-level map, whose values would keep every graph alive).
_CHECKS_ATTRIBUTE = "_tf1_safe_train_nonfinite_checks"


def written_is_nonfinite(variable):
  """Like is_nonfinite, of `variable`'s value read under the caller's deps.

  A resource variable gets a new read. A ref variable's value is read by the
  check itself from the variable's ref: Grappler may rewrite an Identity read
  of a ref variable (`read_value()`) into the variable's cached snapshot,
  which can run before the updates the caller's control dependencies name.
  """
  if rollback.is_ref_variable(variable):
    return _check(variable._ref())  # pylint: disable=protected-access
  return _check(variable.read_value())


def sum_duplicates(grad):
  """`grad` with the values of repeated `IndexedSlices` indices summed.

  The wrapped optimizers sum them before applying
  (`Optimizer._deduplicate_indexed_slices`, same ops): checked before that
  sum, two finite values of one embedding row (2e38 + 2e38 in float32) would
  pass and write -Inf. Dense gradients and None are returned as they are.

  Args:
    grad: a Tensor, an `IndexedSlices` or None.

  Returns:
    `grad`, or an `IndexedSlices` with unique indices in first-seen order
    (unique indices keep their values, as in the optimizer's own sum).
  """
  if not isinstance(grad, tf.IndexedSlices):
    return grad
  graph = grad.values.graph
  with graph.colocate_with(grad.values.op), tf1.name_scope("sum_duplicates"):
    unique, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, positions,
                                          tf.shape(unique)[0])
  return tf.IndexedSlices(values, unique, grad.dense_shape)


def nonfinite_flags(grads):
  """Returns a bool vector with one `is_nonfinite` flag per non-None gradient.

  Args:
    grads: a list of gradients; `None` entries are ignored.

  Returns:
    A bool tensor of shape [number of non-None gradients].
  """
  flags = [is_nonfinite(g) for g in grads if g is not None]
  if not flags:
    return tf.zeros([0], dtype=tf.bool)
  return tf.stack(flags)


def any_nonfinite(grads):
  """Returns a bool scalar: True if any of `grads` holds a NaN or an Inf.

  One fused check for many tensors (a tower's gradients), whose ops do not
  grow per tensor the way one `is_nonfinite` chain each does: tensors of one
  dtype and the same shape but the first dimension are concatenated along it
  and checked by one exact `is_finite` pass per such group; the others are
  flattened (a `Reshape`, no kernel launch on a GPU) into one more group. It
  says whether, not which: per-tensor flags are the decision's.
  `IndexedSlices` are checked through their values, `None` entries ignored.
  """
  values = [g.values if isinstance(g, tf.IndexedSlices) else g
            for g in grads if g is not None]
  if not values:
    return tf.constant(False)
  with tf1.name_scope("any_nonfinite"):
    groups = collections.OrderedDict()
    for v in values:
      shape = v.shape
      key = ((v.dtype.base_dtype, tuple(shape[1:].as_list()))
             if shape.rank and shape[1:].is_fully_defined() else None)
      groups.setdefault(key, []).append(v)
    checked = []
    flat = collections.OrderedDict()
    for key, vs in groups.items():
      if key is not None and len(vs) > 1:
        checked.append(tf.concat(vs, axis=0))
      else:
        for v in vs:
          flat.setdefault(v.dtype.base_dtype, []).append(
              v if v.shape.rank == 1 else tf.reshape(v, [-1]))
    checked += [vs[0] if len(vs) == 1 else tf.concat(vs, axis=0)
                for vs in flat.values()]
    flags = [tf.reduce_all(tf.math.is_finite(c)) for c in checked]
    return tf.logical_not(flags[0] if len(flags) == 1
                          else tf.reduce_all(tf.stack(flags)))
