"""The wrapper stacked with loss-scale skips that are not its own.

TF's `MixedPrecisionLossScaleOptimizer` with a dynamic scale (also what
`enable_mixed_precision_graph_rewrite(opt)` returns) applies in a `tf.cond`
on its own finiteness check, and so does a script's own loss-scale cond
around the apply (tf_cnn_benchmarks' `--fp16_enable_auto_loss_scale`): a
wrapper built in such a branch is not called on a poisoned step, so the
skip is not counted and what runs next to the step (an EMA, update ops)
cannot be undone. Such a step is refused (the loss-scale optimizer) or told
(a script's cond) at graph build, with the lines that put the wrapper
outside. Outside, the loss-scale optimizer's scale halves on the wrapper's
skip (`branch_ops`), as it would on its own, and a script's loss-scale cond
next to the step keeps what it writes on a skip (`loss_scale_cond_writes`).
"""

import re
import sys

from absl import logging
import numpy as np
import tensorflow as tf

from tensorflow.python.ops import control_flow_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_v2_func_graphs  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train.core import cond_walk
from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import keras_route
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

_LOSS_SCALE_OPTIMIZER = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer
# Ops that test values for NaN or Inf: a tf.cond on one is a loss scale's
# (or another step's) own decision on the verdict.
_FINITENESS_TYPES = frozenset(["IsFinite", "IsNan", "IsInf"])
# How far up the stack the loss-scale optimizer's frame can be: its
# apply_gradients, merge_call, _distributed_apply, smart_cond, the cond's
# branch building, call_for_each_replica, then the wrapper's apply_gradients.
_MAX_FRAMES = 40

_WRAPPED = (
    "SkipNonFiniteOptimizer is wrapped by %s with a dynamic loss scale, "
    "which skips a step with non-finite gradients without calling it: the "
    "skip would not be counted and what runs next to the step (an "
    "ExponentialMovingAverage, update ops) would still write. Wrap in the "
    "other order, the loss-scale line first and then `opt = "
    "SkipNonFiniteOptimizer(opt)`, e.g. `opt = SkipNonFiniteOptimizer("
    "tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite("
    "opt))` or `opt = SkipNonFiniteOptimizer(tf.compat.v1.mixed_precision."
    "MixedPrecisionLossScaleOptimizer(opt, 'dynamic'))`: the wrapper then "
    "decides, counts and protects every skip, and the loss scale still "
    "halves on it")

_INSIDE_COND = (
    "tf1_safe_train: SkipNonFiniteOptimizer.apply_gradients is built inside "
    "the tf.cond '%s': on a step that cond does not take this branch (a "
    "loss-scale cond skipping non-finite gradients), the wrapper is not "
    "called, so that skip is not counted and nothing next to the step (an "
    "ExponentialMovingAverage, update ops) is undone. If that cond skips "
    "non-finite gradients, build the apply outside it, "
    "`apply_op = opt.apply_gradients(grads_and_vars)` before the tf.cond, "
    "keep only the loss-scale update in its branches, and group both: the "
    "wrapper skips and counts the step itself")


def enclosing_cond(graph=None, context=None):
  """The name of the `tf.cond` whose branch is being built, or None.

  Args:
    graph: the graph (default: the default graph).
    context: the v1 control-flow context (default: the graph's current one;
      an op's, for where the op was built).
  """
  graph = graph or tf1.get_default_graph()
  if context is None:
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
  while context is not None:  # tf.cond v1: a CondContext, "<cond>/cond_text".
    if isinstance(context, control_flow_ops.CondContext):
      return re.sub(r"/cond_text(_\d+)?$", "", context.name)
    context = context.outer_context
  while graph is not None:  # v2: a branch function, "<cond>_false_<n>".
    if isinstance(graph, control_flow_v2_func_graphs.CondBranchFuncGraph):
      return re.sub(r"_(true|false)_\d+$", "", graph.name)
    graph = getattr(graph, "outer_graph", None)
  return None


def _wrapping_loss_scale_optimizer(wrapper):
  """The `MixedPrecisionLossScaleOptimizer` up the stack around `wrapper`."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  for _ in range(_MAX_FRAMES):
    if frame is None:
      return None
    caller = frame.f_locals.get("self")
    if (isinstance(caller, _LOSS_SCALE_OPTIMIZER) and
        getattr(caller, "_optimizer", None) is wrapper):
      return caller
    frame = frame.f_back
  return None


def check_step_place(wrapper, strict):
  """Refuses or tells a step built where a skip would escape the wrapper.

  Graph mode only (`keras_route.check_graph_mode`); inside the dynamic
  `tf.cond` of a `MixedPrecisionLossScaleOptimizer` around `wrapper`:
  refused; inside another `tf.cond` (a script's loss-scale cond, or one
  that applies every N steps): told, refused if `strict`.

  Raises:
    ValueError: as said.
  """
  keras_route.check_graph_mode()
  cond = enclosing_cond()
  if cond is None:
    return
  outer = _wrapping_loss_scale_optimizer(wrapper)
  if outer is not None:
    raise ValueError(_WRAPPED % type(outer).__name__)
  if strict:
    raise ValueError(_INSIDE_COND % cond)
  logging.warning(_INSIDE_COND, cond)


def check_protectable(applied):
  """Refuses `protect` of a step built inside a tf.cond (`check_step_place`).

  Its decision (`applied`) runs only when that cond takes its branch: a
  rollback outside that reads it would fail at run time (TensorFlow's
  "Retval[1] does not have value").

  Raises:
    ValueError: naming the cond and the lines that build the step outside.
  """
  cond = enclosing_cond(
      applied.graph, applied.op._get_control_flow_context())  # pylint: disable=protected-access
  if cond is not None:
    raise ValueError(
        "protect() cannot undo writes next to a step built inside a tf.cond: "
        + _INSIDE_COND[len("tf1_safe_train: "):] % cond)


class _WrappedScale(object):
  """The branch ops of a wrapped loss-scale optimizer's dynamic scale."""

  def __init__(self, loss_scale):
    self._loss_scale = loss_scale

  def on_apply(self):
    # The loss-scale optimizer's apply_gradients, in the apply branch, counts
    # the good step itself.
    return tf.no_op()

  def on_skip(self):
    # Its scale's own update, told the step overflowed: halve, restart the
    # count toward growth (what it does when it skips alone).
    update, _ = self._loss_scale.update([tf.constant(np.nan, tf.float32)])
    return update


def branch_ops(optimizer, own_loss_scale=None):
  """The guard's `branch_ops` of a step over `optimizer`.

  Args:
    optimizer: the wrapped optimizer.
    own_loss_scale: the wrapper's `loss_scale.DynamicLossScale`, or None.

  Returns:
    The wrapper's own scale if any, and the halving of a wrapped
    `MixedPrecisionLossScaleOptimizer`'s dynamic scale on a skip.
  """
  found = [own_loss_scale] if own_loss_scale is not None else []
  if isinstance(optimizer, _LOSS_SCALE_OPTIMIZER):
    scale = optimizer._loss_scale  # pylint: disable=protected-access
    if isinstance(scale, tf1.mixed_precision.DynamicLossScale):
      found.append(_WrappedScale(scale))
  return found


class LossScaleStacking(object):
  """`SkipNonFiniteOptimizer`'s side of a stack with loss-scale skips."""

  def __init__(self, wrapper, optimizer, loss_scale, strict):
    """Args: the wrapper (what a loss-scale optimizer around it holds), the
    optimizer it wraps, its own `DynamicLossScale` (or None), its `strict`."""
    self._wrapper = wrapper
    self._optimizer = optimizer
    self._loss_scale = loss_scale
    self._strict = strict

  def check_step_place(self):
    """`check_step_place` of the wrapper's step being built."""
    check_step_place(self._wrapper, self._strict)

  def branch_ops(self):
    """`branch_ops` of the wrapper's step: its scale's, a wrapped one's."""
    return branch_ops(self._optimizer, self._loss_scale)


def _tests_finiteness(pred, cache):
  """Whether the cond predicate `pred` is computed from a finiteness test."""
  if pred.op not in cache:
    cache[pred.op] = any(
        op.type in _FINITENESS_TYPES
        for op in fetch_gate.ancestors([pred.op], control=False))
  return cache[pred.op]


def loss_scale_cond_writes(ops, fed=frozenset()):
  """Names of the variables a run of `ops` writes in loss-scale conds.

  A loss-scale cond (tf_cnn_benchmarks' `cond_if_grad_has_inf_nan`, built
  next to the step as `check_step_place` says) is a `tf.cond` on a
  finiteness test: what it writes (the scale, halved when the gradients are
  not finite) is meant to change on a skipped step. The first-run check
  does not name those variables and `protect` does not roll them back.
  The wrapper's own decisions are not entered.

  Args:
    ops: the Operations a run fetches (or `protect` is given).
    fed: names of the run's fed tensors.

  Returns:
    A set of variable names.
  """
  if not ops:
    return set()
  decisions = set(writes.decisions(ops[0].graph))
  cache, found = {}, []
  for op in fetch_gate.ancestors(ops, fed):
    if op in decisions:
      continue
    if op.type in cond_walk.V2_COND_OP_TYPES and op.type.endswith("If"):
      if _tests_finiteness(op.inputs[0], cache):
        found.append(op)
    elif op.type in writes.WRITE_OP_TYPES and any(
        isinstance(c, control_flow_ops.CondContext) and
        _tests_finiteness(c.pred, cache) for c in cond_walk.contexts(op)):
      found.append(op)
  try:
    return set(v.op.name for v in writes.written_variables(found))
  except ValueError:  # Writes no rollback could undo: none to keep either.
    return set()
