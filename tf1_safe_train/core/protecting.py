"""`protect` and the wrapper's own variables.

`Protection` is the part of `SkipNonFiniteOptimizer` that owns what its
steps and `protect` add to the graph: `protect` rolls back, on a skipped
step, the writes of ops built after `apply_gradients` (an EMA), and
`variables()` lists the wrapped optimizer's variables with the wrapper's
(counters, shadows, loss scale, criteria's state).
"""

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import loss_scale_stacking
from tf1_safe_train.core import rollback
from tf1_safe_train.core import run_advice

tf1 = tf.compat.v1


class Protection(object):
  """`SkipNonFiniteOptimizer`'s `protect` and `variables`."""

  def __init__(self, optimizer, loss_scale, last_step):
    """Args: the wrapped optimizer, the wrapper's `loss_scale.
    DynamicLossScale` (or None), its `reporting.LastStep`."""
    self._optimizer = optimizer
    self._loss_scale = loss_scale
    self._last_step = last_step
    # What the wrapper's steps and `protect` create: `variables()` has them.
    self._own_variables = []

  def protect(self, op, name="protect"):
    """Returns `op`, made to change nothing on a skipped step.

    `op` (or a list of ops) runs as before; once the last built step is
    decided, every variable it wrote takes back its value from before the
    step if the step was skipped (a shadow copy, taken on applied steps, as
    for moving statistics: see `rollback`). So an `ExponentialMovingAverage`
    built after `apply_gradients` and grouped into the train op leaves its
    shadows bit-identical on a skipped step. `op` may be the whole train op:
    the variables the step itself handles (`global_step`, the skip counters,
    the rolled-back `UPDATE_OPS` targets, and everything the wrapped
    optimizer updates inside the decision) are left to it, and so is what a
    loss-scale cond next to the step writes (a scale halved on the skip:
    `loss_scale_stacking.loss_scale_cond_writes`).

    Each written variable costs one shadow (see `rollback.protect`).

    Args:
      op: an Operation or Tensor (or a list of them) built after
        `apply_gradients`, e.g. `ema.apply(...)` or
        `tf.group(apply_gradient_op, variables_averages_op)`.
      name: name scope of the added ops.

    Returns:
      An Operation that runs `op` and then keeps or undoes what it wrote;
      for a Tensor `op`, a Tensor of its value that does so (tf-slim's
      `train_tensor`, whose value the training loop logs).

    Raises:
      ValueError: if `apply_gradients` has not been called, was built inside
        a tf.cond, or `op` writes something that is not a global or local
        variable.
    """
    last = self._last_step
    result = last.get()
    loss_scale_stacking.check_protectable(result.applied)
    known = graph_variables()
    ops = [rollback.as_op(o) for o in tf.nest.flatten(op)]
    # A loss-scale cond next to the step halves its scale on a skip: kept.
    protected = rollback.protect(
        ops, result.applied, {v.op.name for v in last.variables} |
        loss_scale_stacking.loss_scale_cond_writes(ops),
        last.roots, name)
    self.note_own_variables(known)
    run_advice.note_protected(protected)
    if isinstance(op, tf.Tensor):
      with tf1.control_dependencies([protected]):
        value = tf.identity(op, name=name + "_value")
      run_advice.note_protected(value.op)
      return value
    return protected

  def note_own_variables(self, known):
    """Notes the graph's variables not in `known` (ids) as the wrapper's."""
    self._own_variables += [
        v for v in tf1.global_variables() + tf1.local_variables()
        if id(v) not in known]

  def variables(self):
    """The wrapped optimizer's variables, then the wrapper's in this graph.

    The wrapper's: the skip counters and whatever its steps and `protect`
    created (shadows, loss scale, spike statistics). Keras 2 initializes
    what this returns (`compile(optimizer=SkipNonFiniteOptimizer(...))`).
    """
    graph = tf1.get_default_graph()
    own = [v for v in self._own_variables if v.graph is graph]
    if self._loss_scale is not None:  # Made with the wrapper, not a step.
      own += [v for v in self._loss_scale.all_variables if v.graph is graph]
    last = self._last_step.result
    if last is not None and last.applied.graph is graph:
      own = list(counters_lib.skip_counters(graph)) + own
    found = list(self._optimizer.variables())
    seen = {id(v) for v in found}
    for v in own:
      if id(v) not in seen:
        seen.add(id(v))
        found.append(v)
    return found


def graph_variables():
  """Ids of the default graph's global and local variables."""
  return {id(v) for v in tf1.global_variables() + tf1.local_variables()}
