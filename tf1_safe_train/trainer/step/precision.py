"""Mixed precision: float32 master weights, low-precision compute.

Layers request variables in their input's dtype; under
`float32_master_weights()` a float16 or bfloat16 request creates a float32
variable and returns a cast of it, so the optimizer updates float32 weights
and gradients reach it in float32 (where the finite check runs).
"""

import contextlib

import tensorflow as tf

tf1 = tf.compat.v1

PRECISIONS = {"fp32": tf.float32, "fp16": tf.float16, "bf16": tf.bfloat16}
_LOW = (tf.float16, tf.bfloat16)


def compute_dtype(precision):
  """The compute dtype of 'fp32', 'fp16' or 'bf16'.

  Raises:
    ValueError: for another name.
  """
  if precision not in PRECISIONS:
    raise ValueError("unknown precision %r; expected one of %s" %
                     (precision, ", ".join(PRECISIONS)))
  return PRECISIONS[precision]


def _float32_getter(getter, name, *args, **kwargs):
  dtype = kwargs.get("dtype")
  if dtype not in _LOW:
    return getter(name, *args, **kwargs)
  kwargs["dtype"] = tf.float32
  variable = getter(name, *args, **kwargs)
  return tf.cast(variable, dtype, name=name.split("/")[-1] + "_cast")


@contextlib.contextmanager
def float32_master_weights():
  """Within this block, low-precision variable requests get float32 masters.

  Yields:
    Nothing; opens a variable scope (same name, same reuse) with the getter.
  """
  scope = tf1.get_variable_scope()
  with tf1.variable_scope(scope, custom_getter=_float32_getter,
                          auxiliary_name_scope=False):
    yield
