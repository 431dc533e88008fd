"""The Keras 2 route: `model.compile(optimizer=SkipNonFiniteOptimizer(...))`.

tf_keras wraps a `tf.compat.v1.train.Optimizer` in its `TFOptimizer`, whose
`get_updates` calls the wrapper's `compute_gradients`/`apply_gradients` from
`Model._make_train_function`; the model's own updates (BatchNormalization's
moving statistics, not in `UPDATE_OPS`) are grouped next to the step there,
after it returns. This module finds those updates for the wrapper, gives
Keras' optimizer the `lr` its learning-rate callbacks set, and refuses the
routes a graph-mode step cannot take (eager Keras, `tf.function`).
"""

import numbers
import sys

import tensorflow as tf

from tensorflow.python.ops import control_flow_v2_func_graphs  # pylint: disable=g-direct-tensorflow-import

tf1 = tf.compat.v1

# The tf_keras (2.x) method that asks the optimizer for its updates and then
# groups the model's own updates next to them (engine/training_v1.py).
_TRAIN_FUNCTION_BUILDER = "_make_train_function"
# The TFOptimizer method (tf_keras optimizers/optimizer_v1.py) that calls the
# wrapper's compute_gradients/apply_gradients for that train function.
_OPTIMIZER_UPDATES = "get_updates"
# Where tf.compat.v1.train optimizers keep the rate they were given (Adam and
# Adadelta: `_lr`); `_prepare` reads it when the step is built.
_RATE_ATTRIBUTES = ("_learning_rate", "_lr")
# How far up the stack that frame can be: TFOptimizer.get_updates, the
# wrapper's apply_gradients and _build_step are in between.
_MAX_FRAMES = 12


def check_graph_mode(graph=None):
  """Raises ValueError if the step would be built eagerly or in a tf.function.

  The guard is one `tf.cond` over graph variables, counted and reported by
  session runs: Keras 2 in eager mode calls `apply_gradients` while tracing
  its `tf.function`, where none of that holds. A `tf.cond` or while branch
  inside a graph is fine (control-flow function graphs).
  """
  if tf.executing_eagerly():
    raise ValueError(_GRAPH_MODE_ONLY % "eagerly")
  graph = graph or tf1.get_default_graph()
  while graph is not None and getattr(graph, "building_function", False):
    if not isinstance(graph,
                      control_flow_v2_func_graphs.ControlFlowFuncGraph):
      raise ValueError(_GRAPH_MODE_ONLY % "inside a tf.function")
    graph = getattr(graph, "outer_graph", None)


_GRAPH_MODE_ONLY = (
    "SkipNonFiniteOptimizer builds graph-mode (tf.compat.v1) steps and was "
    "called %s (e.g. Keras in eager mode): call "
    "tf.compat.v1.disable_eager_execution() before building the model")


def _keras_caller(method, accept, max_frames=_MAX_FRAMES):
  """`self` of the nearest tf_keras frame of `method` that `accept`s it."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  for _ in range(max_frames):
    if frame is None:
      return None
    code = frame.f_code
    if code.co_name == method and "keras" in code.co_filename:
      caller = frame.f_locals.get("self")
      if accept(caller):
        return caller
    frame = frame.f_back
  return None


def model_being_compiled(max_frames=_MAX_FRAMES):
  """The tf_keras model whose train function is being built, or None.

  tf_keras passes the optimizer no model and puts the model's updates in no
  collection: the model is `self` of `Model._make_train_function`, a few
  frames up when `TFOptimizer.get_updates` calls the wrapper.
  """
  return _keras_caller(_TRAIN_FUNCTION_BUILDER,
                       lambda model: hasattr(model, "get_updates_for"),
                       max_frames)


def expose_learning_rate(wrapper, optimizer):
  """Gives the tf_keras optimizer calling `wrapper` a settable `lr`.

  Keras' learning-rate callbacks (`LearningRateScheduler`,
  `ReduceLROnPlateau`) read and set `model.optimizer.lr` with
  `backend.get_value`/`set_value`; `model.optimizer` is the `TFOptimizer`
  tf_keras made around the wrapper, which has none. Called while the step
  is built (before `fit` calls any callback): a rate the wrapped optimizer
  was given as a number becomes a float32 variable it reads instead (a
  variable it was given is used as it is), and the `TFOptimizer` gets it as
  `lr` and `learning_rate`. A tensor or callable rate (a schedule) is left
  alone: no callback could set it.

  Args:
    wrapper: the `SkipNonFiniteOptimizer` building its step.
    optimizer: the optimizer it wraps, whose `apply_gradients` comes next.

  Returns:
    The rate variable, or None (not called by tf_keras, or no number).
  """
  keras_optimizer = _keras_caller(
      _OPTIMIZER_UPDATES,
      lambda caller: getattr(caller, "optimizer", None) is wrapper)
  if keras_optimizer is None or hasattr(keras_optimizer, "lr"):
    return None
  attribute = next((a for a in _RATE_ATTRIBUTES if hasattr(optimizer, a)),
                   None)
  rate = getattr(optimizer, attribute, None) if attribute else None
  if not isinstance(rate, tf.Variable):
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
      return None
    with tf1.init_scope():
      rate = tf1.Variable(float(rate), name=optimizer.get_name() + "_lr",
                          trainable=False, dtype=tf.float32,
                          use_resource=True)
    setattr(optimizer, attribute, rate)
  keras_optimizer.lr = keras_optimizer.learning_rate = rate
  return rate


def model_updates(model):
  """The update ops Keras groups into `model`'s train function.

  The same list `_make_train_function` adds after the optimizer's updates:
  the unconditional ones and those of the model's inputs (BatchNormalization's
  moving mean and variance, in a cond on the learning phase).
  """
  updates = list(model.get_updates_for(None))
  updates += model.get_updates_for(model.inputs)
  found = []
  for u in updates:
    op = u if isinstance(u, tf.Operation) else u.op
    if op not in found:
      found.append(op)
  return found


def compiling_model_updates(known=()):
  """`model_updates` of `model_being_compiled()` not in `known`, or [].

  Called from the wrapper's step builder, whose callers are counted in
  `model_being_compiled`'s frames.
  """
  model = model_being_compiled()
  if model is None:
    return []
  known = {u if isinstance(u, tf.Operation) else u.op for u in known}
  return [u for u in model_updates(model) if u not in known]


def compiling_model_metric_variables():
  """The variables of `model_being_compiled()`'s stateful metrics, or [].

  Keras groups its metrics' updates (a running total and count) into the
  train function next to the step. They summarize what was fed, not the
  model's state: a skipped batch is counted in them, as documented, rather
  than named as a write outside the decision that no line could protect.
  """
  model = model_being_compiled()
  if model is None:
    return []
  found = []
  for metric in getattr(model, "metrics", []):
    for variable in getattr(metric, "variables", []):
      if all(variable is not v for v in found):
        found.append(variable)
  return found
