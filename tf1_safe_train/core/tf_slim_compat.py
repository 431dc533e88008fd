"""tf-slim 1.1.0 on TensorFlow 2.21: the names it reaches that moved.

tf-slim (the last release, 2020) calls TensorFlow's private modules by
their 2.2 layout: `control_flow_ops.cond/case/Assert/while_loop`,
`ops.Tensor`, and, through `tensorflow/python/layers/normalization.py`,
`tf_keras.legacy_tf_layers` (now `tf_keras.src.legacy_tf_layers`). Its import
works; its layers, `arg_scope`-ed models and `learning` then fail at the
first use of one of them. `patch_tf_slim()` puts those names back, opt-in:
nothing here runs, and neither tf_slim nor tf_keras is imported, unless it
is called.
"""

import importlib
import pkgutil
import sys

import tensorflow as tf  # pylint: disable=unused-import

from tensorflow.python.framework import ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import tensor  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_ops  # pylint: disable=g-direct-tensorflow-import

# control_flow_ops.<name> -> the module that holds it since TF 2.14.
_CONTROL_FLOW = {
    "cond": "tensorflow.python.ops.cond",
    "case": "tensorflow.python.ops.control_flow_case",
    "Assert": "tensorflow.python.ops.control_flow_assert",
    "while_loop": "tensorflow.python.ops.while_loop",
}
# Where TensorFlow's lazy `tf.compat.v1.layers` batch norm looks, and where
# tf-keras 2.21 keeps it.
_KERAS_LAYERS = "tf_keras.legacy_tf_layers"
_KERAS_LAYERS_NOW = "tf_keras.src.legacy_tf_layers"

_NO_TF_KERAS = (
    "patch_tf_slim needs tf-keras (tf-slim's batch_norm is Keras 2's "
    "legacy layer): pip install --no-deps tf-keras==2.21.0 (--no-deps: its "
    "requirement on the full tensorflow wheel would install a second "
    "TensorFlow)")


def patch_tf_slim():
  """Makes tf-slim 1.1.0 usable on TensorFlow 2.21; call before using it.

  Before or after `import tf_slim` (its modules look these names up when
  they build ops), once per process; later calls change nothing. Adds only
  names TensorFlow no longer has, never replaces one it has.

  Returns:
    The names added, e.g. ["control_flow_ops.cond", ...]; [] on a later
    call.

  Raises:
    ImportError: tf-keras is not installed.
  """
  added = []
  for name, module in sorted(_CONTROL_FLOW.items()):
    if not hasattr(control_flow_ops, name):
      setattr(control_flow_ops, name,
              getattr(importlib.import_module(module), name))
      added.append("control_flow_ops." + name)
  if not hasattr(ops, "Tensor"):
    ops.Tensor = tensor.Tensor
    added.append("ops.Tensor")
  if _KERAS_LAYERS not in sys.modules:
    added.extend(_alias_keras_layers())
  return added


def _alias_keras_layers():
  """Registers tf_keras.src.legacy_tf_layers (and its modules) under the
  name TensorFlow's `layers/normalization.py` imports lazily."""
  try:
    importlib.import_module(_KERAS_LAYERS)
    return []  # A tf-keras that still has it.
  except ImportError:
    pass
  try:
    package = importlib.import_module(_KERAS_LAYERS_NOW)
  except ImportError as e:
    raise ImportError(_NO_TF_KERAS, name="tf_keras") from e
  sys.modules[_KERAS_LAYERS] = package
  added = [_KERAS_LAYERS]
  for module in pkgutil.iter_modules(package.__path__):
    old = "%s.%s" % (_KERAS_LAYERS, module.name)
    sys.modules[old] = importlib.import_module(
        "%s.%s" % (_KERAS_LAYERS_NOW, module.name))
    added.append(old)
  return added
