"""A tiny model, its inputs and TF configurations for the optimizer tests.

Shared by optimizer_test and protect_test: a 3-vector and a scalar whose every
gradient is NaN when the input holds a NaN, two finite batches and a poisoned
one, and a context manager that switches the cond and variable kinds.
"""

import contextlib

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

NAN = float("nan")

# Two finite batches and one whose NaN makes every gradient of `model` NaN.
GOOD_X = np.array([0.5, -1.5, 2.0], np.float32)
GOOD_X2 = np.array([1.25, 0.75, -0.5], np.float32)
NAN_X = np.array([0.5, NAN, 2.0], np.float32)


@contextlib.contextmanager
def tf_config(control_flow_v2=True, resource_variables=True):
  """Sets the cond implementation and variable kind; restores them after.

  Args:
    control_flow_v2: build v2 conds (an If op) rather than v1 (Switch/Merge).
    resource_variables: create resource variables rather than ref variables.

  Yields:
    Nothing; the settings hold inside the `with` block.
  """
  old_cf = tf1.control_flow_v2_enabled()
  old_rv = tf1.resource_variables_enabled()
  try:
    (tf1.enable_control_flow_v2 if control_flow_v2 else
     tf1.disable_control_flow_v2)()
    (tf1.enable_resource_variables if resource_variables else
     tf1.disable_resource_variables)()
    yield
  finally:
    (tf1.enable_control_flow_v2 if old_cf else tf1.disable_control_flow_v2)()
    (tf1.enable_resource_variables if old_rv else
     tf1.disable_resource_variables)()


def model(x, scope="model"):
  """A 3-vector and a scalar; every gradient is NaN if x holds a NaN.

  Args:
    x: a float32 tensor of shape [3], e.g. fed `GOOD_X` or `NAN_X`.
    scope: the variable scope of the two variables.

  Returns:
    (the scalar loss, [w, b]).
  """
  with tf1.variable_scope(scope):
    w = tf1.get_variable("w", initializer=tf.constant([0.25, -0.5, 1.0]))
    b = tf1.get_variable("b", initializer=tf.constant(0.125))
  loss = (tf.reduce_sum(tf.square(w * x - 1.0)) +
          tf.square(b - tf.reduce_mean(x)))
  return loss, [w, b]


def snapshot(sess, exclude=()):
  """Values of every global variable but `exclude`, by name.

  Args:
    sess: the session to read the variables in.
    exclude: variables to leave out (e.g. counters that a skip changes).

  Returns:
    {variable op name: numpy value}.
  """
  excluded = {v.op.name for v in exclude}
  variables = [v for v in tf1.global_variables() if v.op.name not in excluded]
  return dict(zip([v.op.name for v in variables], sess.run(variables)))
