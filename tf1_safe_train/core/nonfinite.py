"""Exact finiteness checks of gradients and written variables.

A value is non-finite if any element is NaN, +Inf or -Inf: tested element by
element (`tf.math.is_finite`), never through a sum or norm that could
overflow on large finite values. The decision (`guard`) and the reports use
these checks.
"""

import collections
import contextlib

import tensorflow as tf

from tf1_safe_train.core import shadows

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
  if not _outside_control_flow(graph):
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


def _outside_control_flow(graph):
  # pylint: disable=protected-access
  in_control_flow = graph._get_control_flow_context() is not None
  # pylint: enable=protected-access
  return (graph is tf1.get_default_graph() and not graph.building_function
          and not in_control_flow)


@contextlib.contextmanager
def _free_of_control_dependencies(graph):
  """Builds a check that waits for nothing but its input.

  Only outside control flow: `control_dependencies(None)` would also leave
  a v1 cond's or loop's context.
  """
  if _outside_control_flow(graph):
    with tf1.control_dependencies(None):
      yield
  else:
    yield


# Flags already built in a graph, by checked tensor. An attribute of the graph
# (not a module-level map, whose values would keep every graph alive).
_CHECKS_ATTRIBUTE = "_tf1_safe_train_nonfinite_checks"


def written_is_nonfinite(variable):
  """Like is_nonfinite, of `variable`'s value read under the caller's deps
  (by `shadows.read_written`: a ref variable's by the check itself)."""
  return _check(shadows.read_written(variable))


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

  One fused check for many tensors (a step's or a tower's gradients), whose
  ops do not grow per tensor the way one `is_nonfinite` chain each does:
  on each device, tensors of one dtype and the same shape but the first
  dimension (from `_MIN_GROUP` of them) are concatenated along it and
  checked by one exact `is_finite` pass per such group; the others are
  flattened (a `Reshape`, no kernel launch on a GPU) into one 1-D pass per
  device and dtype. The concatenation copies bytes to
  save kernel launches, a trade that pays for small tensors only: a tensor
  of more than `MAX_FUSED_ELEMENTS` elements, or of unknown size (e.g. an
  `IndexedSlices`' values), gets its own check, and a group is split so
  that no copy exceeds that size. It says whether, not which (see
  `nonfinite_flags`). `IndexedSlices` are checked through their values,
  `None` entries ignored. Built like `is_nonfinite`, free of the caller's
  control dependencies (outside control flow).
  """
  values = [_values(g) for g in grads if g is not None]
  if not values:
    return tf.constant(False)
  with _free_of_control_dependencies(values[0].graph):
    return _any_nonfinite(values)


def any_written_nonfinite(values):
  """Like `any_nonfinite`, of written variables' `values` (read as
  `shadows.read_written` reads them), built under the caller's control
  dependencies, which the reads of a ref variable's value need; False if
  none."""
  if not values:
    return tf.constant(False)
  return _any_nonfinite(values)


def _any_nonfinite(values):
  with tf1.name_scope("any_nonfinite"):
    joined, constants = _joined(values)
    finite = []
    for checked in joined:
      with checked.graph.colocate_with(checked.op):
        rank = checked.shape.rank
        axes = (None if rank is None else
                constants.get(checked, list(range(rank))))
        finite.append(tf.reduce_all(tf.math.is_finite(checked), axis=axes))
    return tf.logical_not(finite[0] if len(finite) == 1
                          else tf.reduce_all(tf.stack(finite)))


def fused(grads):
  """The tensors one fused pass over `grads` reads (`any_nonfinite`'s
  concatenations): the same nodes for every pass over the same gradients
  (a tower's check and its norm, `norms.fused_global_norm`), built once
  per graph outside control flow, free of the caller's control
  dependencies."""
  values = [_values(g) for g in grads if g is not None]
  if not values:
    return []
  with _free_of_control_dependencies(values[0].graph):
    return _joined(values)[0]


def _joined(values):
  """([one tensor per fused pass], the passes' constants) of `values`."""
  graph = values[0].graph
  key = tuple(v.ref() for v in values)
  cache = None
  if _outside_control_flow(graph):
    cache = getattr(graph, _JOINED_ATTRIBUTE, None)
    if cache is None:
      cache = {}
      setattr(graph, _JOINED_ATTRIBUTE, cache)
    if key in cache:
      return cache[key]
  constants = _Constants(graph)
  joined = []
  for batch in _batches(values, constants):
    first = batch[0]
    with graph.colocate_with(first.op):
      joined.append(first if len(batch) == 1 else
                    tf.concat(batch, axis=constants.get(first, 0)))
  if cache is not None:
    cache[key] = (joined, constants)
  return joined, constants


# The fused passes' tensors already built in a graph, by their inputs.
_JOINED_ATTRIBUTE = "_tf1_safe_train_fused_passes"


class _Constants(object):
  """The axes and shapes the checks of one device share (one node each)."""

  def __init__(self, graph):
    self._graph = graph
    self._built = {}

  def get(self, near, value):
    """An int32 constant `value` built with the first tensor `near` asks."""
    key = (near.device, repr(value))
    if key not in self._built:
      with self._graph.colocate_with(near.op):
        self._built[key] = tf.constant(value, tf.int32)
    return self._built[key]


# Tensors up to this many elements are checked concatenated: below it a
# kernel launch costs more than copying the bytes (on a GPU, ~5 us against
# 4 MiB of float32 at several hundred GB/s); above it the copy would cost
# more, and it bounds the memory a fused check holds.
MAX_FUSED_ELEMENTS = 1 << 20

# A group of same-shaped tensors (but the first dimension) gets a check of
# its own (a concatenation, `is_finite`, a reduction: 3 nodes) from this
# many tensors on; fewer are flattened into their device's 1-D check (a
# `Reshape` each).
_MIN_GROUP = 4


def _batches(values, constants):
  """`values` in lists, each checked by one pass (see any_nonfinite)."""
  alone, groups = [], collections.OrderedDict()
  for v in values:
    size = v.shape.num_elements()
    if size is None or size > MAX_FUSED_ELEMENTS:
      alone.append([v])
      continue
    trailing = tuple(v.shape[1:].as_list()) if v.shape.rank else None
    groups.setdefault((v.device, v.dtype.base_dtype, trailing), []).append(v)
  joined, flat = [], collections.OrderedDict()
  for (device, dtype, trailing), vs in groups.items():
    if trailing and len(vs) >= _MIN_GROUP:
      joined.append(vs)
    else:
      flat.setdefault((device, dtype), []).extend(vs)
  for vs in flat.values():
    if len(vs) > 1:
      vs = [v if v.shape.rank == 1 else _flattened(v, constants) for v in vs]
    joined.append(vs)
  batches = []
  for vs in joined:
    batch, size = [], 0
    for v in vs:
      if batch and size + v.shape.num_elements() > MAX_FUSED_ELEMENTS:
        batches.append(batch)
        batch, size = [], 0
      batch.append(v)
      size += v.shape.num_elements()
    batches.append(batch)
  return batches + alone


def _flattened(value, constants):
  with value.graph.colocate_with(value.op):
    return tf.reshape(value, constants.get(value, [-1]))
