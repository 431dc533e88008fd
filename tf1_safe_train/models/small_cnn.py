"""The small CNN of the TensorFlow CIFAR-10 tutorial, on 32x32x3 images.

Two 5x5 convolutions with max pooling and local response normalisation, then
two fully connected layers and a linear classifier, with the tutorial's
initialisers (tensorflow/models `tutorials/image/cifar10/cifar10.py`).
"""

import tensorflow as tf

from tf1_safe_train.models import layers

tf1 = tf.compat.v1

SCOPE = "small_cnn"


def _truncated_normal(stddev):
  return tf1.truncated_normal_initializer(stddev=stddev)


def _lrn(x, name):
  # The tutorial's normalisation constants, kept for faithfulness. LRN has
  # no bfloat16 kernel on CPU: compute that case in float32.
  y = tf.nn.local_response_normalization(
      tf.cast(x, tf.float32) if x.dtype == tf.bfloat16 else x,
      depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name=name)
  return tf.cast(y, x.dtype)


def small_cnn(images, is_training, num_classes=10):
  """Builds the tutorial CNN and returns its logits.

  The network has no batch norm and no dropout, so `is_training` changes
  nothing; it is taken so every model has the same signature. Variables come
  from `get_variable` under the scope "small_cnn", so calling this again under
  a reusing variable scope (one call per tower) shares them.

  Args:
    images: float32 tensor [batch, height, width, 3] with static height and
      width (32x32 for CIFAR-10).
    is_training: Python bool (unused, see above).
    num_classes: number of classes.

  Returns:
    float32 logits [batch, num_classes].

  Raises:
    ValueError: if `images` is not float32 NHWC with static spatial shape and
      3 channels, or `num_classes` is not a positive int.
  """
  del is_training  # No layer behaves differently in training.
  layers.check_model_inputs(images, num_classes, "small_cnn")
  with tf1.variable_scope(SCOPE):
    x = layers.conv2d(images, 64, 5, scope="conv1",
                      kernel_initializer=_truncated_normal(5e-2))
    x = tf.nn.relu(x)
    x = layers.max_pool(x, 3, 2, name="pool1")
    x = _lrn(x, "norm1")
    x = layers.conv2d(x, 64, 5, scope="conv2",
                      kernel_initializer=_truncated_normal(5e-2),
                      bias_initializer=tf1.constant_initializer(0.1))
    x = tf.nn.relu(x)
    x = _lrn(x, "norm2")
    x = layers.max_pool(x, 3, 2, name="pool2")
    x = tf.reshape(x, [-1, x.shape[1] * x.shape[2] * x.shape[3]])
    x = layers.dense(x, 384, "local3",
                     kernel_initializer=_truncated_normal(0.04),
                     bias_initializer=tf1.constant_initializer(0.1))
    x = tf.nn.relu(x)
    x = layers.dense(x, 192, "local4",
                     kernel_initializer=_truncated_normal(0.04),
                     bias_initializer=tf1.constant_initializer(0.1))
    x = tf.nn.relu(x)
    return layers.dense(x, num_classes, "softmax_linear",
                        kernel_initializer=_truncated_normal(1 / 192.0))

