"""Graph-mode layers built from `tf.compat.v1.get_variable` and `tf.nn` ops.

Each layer opens its own variable scope and creates its variables with
`get_variable`, so a model made of these layers can be built once per tower
under a reusing variable scope and share one set of variables.

Variable names are part of the contract: kernels are `<scope>/weights` (the
trainer applies weight decay to exactly these), biases `<scope>/biases`, and
batch norm owns `beta`, `gamma`, `moving_mean` and `moving_variance`.

Kernels and biases take the input's dtype, so a float16 or bfloat16 input
computes in that precision; build the model under
`precision.float32_master_weights()` to keep float32 master variables. Batch
norm's parameters and statistics are always float32.
"""

import tensorflow as tf

from tf1_safe_train.core import checks

tf1 = tf.compat.v1

WEIGHTS = "weights"
BIASES = "biases"
BETA = "beta"
GAMMA = "gamma"
MOVING_MEAN = "moving_mean"
MOVING_VARIANCE = "moving_variance"


def he_initializer():
  """He et al. (2015) initialiser: truncated normal with variance 2 / fan_in."""
  return tf1.variance_scaling_initializer(
      scale=2.0, mode="fan_in", distribution="truncated_normal")


def _check_rank(x, rank, layer):
  if x.shape.rank != rank:
    raise ValueError("%s expects a rank-%d input, got shape %s" %
                     (layer, rank, x.shape))


def _check_positive_int(value, what):
  if not checks.is_int(value) or value <= 0:
    raise ValueError("%s must be a positive int, got %r" % (what, value))


def check_model_inputs(images, num_classes, model):
  """Validates a model function's arguments.

  Args:
    images: the images tensor given to the model.
    num_classes: the number of classes given to the model.
    model: the model's name, for the message.

  Raises:
    ValueError: unless `images` is float [batch, height, width, 3] with
      static height and width and `num_classes` is a positive int.
  """
  if not checks.is_int(num_classes) or num_classes <= 0:
    raise ValueError("%s: num_classes must be a positive int, got %r" %
                     (model, num_classes))
  if images.dtype not in (tf.float32, tf.float16, tf.bfloat16):
    raise ValueError("%s: images must be float32, float16 or bfloat16, got %s"
                     % (model, images.dtype.name))
  shape = images.shape
  if shape.rank != 4 or None in shape[1:] or shape[3] != 3:
    raise ValueError("%s: images must be [batch, height, width, 3] with "
                     "static height and width, got %s" % (model, shape))


def conv2d(x,
           filters,
           kernel_size,
           strides=1,
           *,
           scope,
           use_bias=True,
           padding="SAME",
           kernel_initializer=None,
           bias_initializer=None):
  """2-D convolution over an NHWC input.

  Args:
    x: float32 tensor [batch, height, width, channels]; channels must be
      statically known.
    filters: number of output channels.
    kernel_size: side of the square kernel.
    strides: stride in both spatial dimensions.
    scope: variable scope of the layer (keyword only).
    use_bias: whether to add `biases` (off when batch norm follows).
    padding: "SAME" or "VALID".
    kernel_initializer: initialiser of `weights`; He (variance scaling,
      fan_in, scale 2) if None.
    bias_initializer: initialiser of `biases`; zeros if None.

  Returns:
    The float32 tensor [batch, height', width', filters].

  Raises:
    ValueError: if the input is not rank 4 or an argument is invalid.
  """
  _check_rank(x, 4, "conv2d")
  _check_positive_int(filters, "conv2d filters")
  _check_positive_int(kernel_size, "conv2d kernel_size")
  _check_positive_int(strides, "conv2d strides")
  if padding not in ("SAME", "VALID"):
    raise ValueError("conv2d padding must be 'SAME' or 'VALID', got %r" %
                     (padding,))
  in_channels = x.shape[-1]
  if in_channels is None:
    raise ValueError("conv2d needs a static channel count, got shape %s" %
                     x.shape)
  with tf1.variable_scope(scope):
    kernel = tf1.get_variable(
        WEIGHTS, [kernel_size, kernel_size, in_channels, filters],
        dtype=x.dtype,
        initializer=kernel_initializer or he_initializer())
    y = tf.nn.conv2d(x, kernel, strides=[1, strides, strides, 1],
                     padding=padding)
    if use_bias:
      biases = tf1.get_variable(
          BIASES, [filters], dtype=x.dtype,
          initializer=bias_initializer or tf1.zeros_initializer())
      y = tf.nn.bias_add(y, biases)
    return y


def dense(x, units, scope, use_bias=True, kernel_initializer=None,
          bias_initializer=None):
  """Fully connected layer `x @ weights + biases`.

  Args:
    x: float32 tensor [batch, features]; features must be statically known.
    units: number of outputs.
    scope: variable scope of the layer.
    use_bias: whether to add `biases`.
    kernel_initializer: initialiser of `weights`; Glorot uniform if None.
    bias_initializer: initialiser of `biases`; zeros if None.

  Returns:
    The float32 tensor [batch, units].

  Raises:
    ValueError: if the input is not rank 2 or an argument is invalid.
  """
  _check_rank(x, 2, "dense")
  _check_positive_int(units, "dense units")
  in_features = x.shape[-1]
  if in_features is None:
    raise ValueError("dense needs a static feature count, got shape %s" %
                     x.shape)
  with tf1.variable_scope(scope):
    kernel = tf1.get_variable(
        WEIGHTS, [in_features, units], dtype=x.dtype,
        initializer=kernel_initializer or tf1.glorot_uniform_initializer())
    y = tf.linalg.matmul(x, kernel)
    if use_bias:
      biases = tf1.get_variable(
          BIASES, [units], dtype=x.dtype,
          initializer=bias_initializer or tf1.zeros_initializer())
      y = tf.nn.bias_add(y, biases)
    return y


def batch_norm(x, is_training, scope, decay=0.9, epsilon=1e-3):
  """Fused batch normalisation of an NHWC input, with moving statistics.

  In training the batch's statistics normalise `x`, and two update ops, one
  per moving statistic, `var -= (var - batch_stat) * (1 - decay)`, are added
  to `tf.compat.v1.GraphKeys.UPDATE_OPS` and nowhere else: whoever builds the
  train op decides whether and when they run (the legacy TF1 contract). The
  batch variance is the unbiased (Bessel-corrected) one that
  `fused_batch_norm` returns. In inference the moving statistics normalise
  `x` and no update op is made.

  Args:
    x: float32 tensor [batch, height, width, channels]; channels must be
      statically known.
    is_training: Python bool; True uses batch statistics and makes updates.
    scope: variable scope of the layer.
    decay: moving-average decay in [0, 1).
    epsilon: added to the variance; at least 1.001e-5 (fused kernel limit).

  Returns:
    The normalised float32 tensor, same shape as `x`.

  Raises:
    ValueError: if the input is not rank 4 or an argument is invalid.
  """
  _check_rank(x, 4, "batch_norm")
  if not isinstance(is_training, bool):
    raise ValueError("batch_norm is_training must be a Python bool, got %r" %
                     (is_training,))
  if not 0.0 <= decay < 1.0:
    raise ValueError("batch_norm decay must be in [0, 1), got %r" % (decay,))
  if epsilon < 1.001e-5:
    raise ValueError("batch_norm epsilon must be >= 1.001e-5, got %r" %
                     (epsilon,))
  channels = x.shape[-1]
  if channels is None:
    raise ValueError("batch_norm needs a static channel count, got shape %s" %
                     x.shape)
  with tf1.variable_scope(scope):
    beta = tf1.get_variable(BETA, [channels], dtype=tf.float32,
                            initializer=tf1.zeros_initializer())
    gamma = tf1.get_variable(GAMMA, [channels], dtype=tf.float32,
                             initializer=tf1.ones_initializer())
    moving_mean = tf1.get_variable(
        MOVING_MEAN, [channels], dtype=tf.float32,
        initializer=tf1.zeros_initializer(), trainable=False)
    moving_variance = tf1.get_variable(
        MOVING_VARIANCE, [channels], dtype=tf.float32,
        initializer=tf1.ones_initializer(), trainable=False)
    if not is_training:
      y, _, _ = tf1.nn.fused_batch_norm(
          x, gamma, beta, mean=moving_mean, variance=moving_variance,
          epsilon=epsilon, data_format="NHWC", is_training=False)
      return y
    y, batch_mean, batch_variance = tf1.nn.fused_batch_norm(
        x, gamma, beta, epsilon=epsilon, data_format="NHWC", is_training=True)
    for name, var, stat in ((MOVING_MEAN, moving_mean, batch_mean),
                            (MOVING_VARIANCE, moving_variance,
                             batch_variance)):
      with tf1.name_scope(name + "_update"):
        # read_value=False yields the assign Operation itself for both
        # resource and ref variables; nothing reads it back.
        update = var.assign_sub((var - stat) * (1.0 - decay),
                                read_value=False)
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
    return y


def max_pool(x, pool_size, strides, padding="SAME", name="max_pool"):
  """Max pooling over an NHWC input with square windows.

  Args:
    x: float32 tensor [batch, height, width, channels].
    pool_size: side of the square window.
    strides: stride in both spatial dimensions.
    padding: "SAME" or "VALID".
    name: name scope of the op.

  Returns:
    The pooled tensor.
  """
  _check_rank(x, 4, "max_pool")
  return tf.nn.max_pool2d(x, ksize=[1, pool_size, pool_size, 1],
                          strides=[1, strides, strides, 1], padding=padding,
                          name=name)
