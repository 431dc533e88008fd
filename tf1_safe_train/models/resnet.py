"""The CIFAR-10 ResNets (He et al. 2016, "Deep Residual Learning", 4.2).

A 3x3 convolution with 16 filters, three stages of n basic blocks with 16, 32
and 64 filters (the first block of stages 2 and 3 has stride 2), batch norm
and ReLU after every convolution, global average pooling and a dense
classifier: 6n + 1 convolutions plus one dense layer, depth 6n + 2.
ResNet-20 (n = 3, about 0.27M parameters) is the paper's smallest; ResNet-8
(n = 1, 75K parameters) has the same kinds of layers (batch norm,
strided blocks, shortcuts) at about a third of the graph, for quick runs
that need batch norm.
"""

import tensorflow as tf

from tf1_safe_train.models import layers

tf1 = tf.compat.v1

STAGE_FILTERS = (16, 32, 64)
# "A": parameter-free shortcut (subsample + zero-pad channels), the paper's
# CIFAR choice. "B": projection (1x1 convolution + batch norm).
SHORTCUTS = ("A", "B")


def _conv_bn(x, filters, kernel_size, strides, is_training, scope, relu=True):
  """Convolution (no bias: batch norm's beta replaces it), batch norm, ReLU."""
  with tf1.variable_scope(scope):
    x = layers.conv2d(x, filters, kernel_size, strides, scope="conv",
                      use_bias=False)
    x = layers.batch_norm(x, is_training, "bn")
    return tf.nn.relu(x) if relu else x


def _shortcut(x, filters, strides, is_training, shortcut):
  """Matches `x` to the block output's shape when that shape changes."""
  in_filters = x.shape[-1]
  if strides == 1 and in_filters == filters:
    return x
  if shortcut == "B":
    return _conv_bn(x, filters, 1, strides, is_training, "projection",
                    relu=False)
  with tf1.name_scope("shortcut_a"):
    x = x[:, ::strides, ::strides, :]
    extra = filters - in_filters
    return tf.pad(x, [[0, 0], [0, 0], [0, 0], [extra // 2, extra - extra // 2]])


def _basic_block(x, filters, strides, is_training, shortcut, scope):
  """Two 3x3 conv-BN layers whose output is added to the shortcut, then ReLU."""
  with tf1.variable_scope(scope):
    residual = _conv_bn(x, filters, 3, strides, is_training, "conv_bn1")
    residual = _conv_bn(residual, filters, 3, 1, is_training, "conv_bn2",
                        relu=False)
    return tf.nn.relu(residual +
                      _shortcut(x, filters, strides, is_training, shortcut))


def resnet20(images, is_training, num_classes=10, shortcut="A"):
  """Builds ResNet-20 (n = 3) under the scope "resnet20"; see `_resnet`."""
  return _resnet(images, is_training, num_classes, shortcut, 3, "resnet20")


def resnet8(images, is_training, num_classes=10, shortcut="A"):
  """Builds ResNet-8 (n = 1) under the scope "resnet8"; see `_resnet`."""
  return _resnet(images, is_training, num_classes, shortcut, 1, "resnet8")


def _resnet(images, is_training, num_classes, shortcut, blocks_per_stage,
            name):
  """Builds a CIFAR ResNet of depth 6 * `blocks_per_stage` + 2; its logits.

  Variables come from `get_variable` under the scope `name`, so calling this
  again under a reusing variable scope (one call per tower) shares them.
  In training every batch norm adds its two moving-statistics updates to
  `tf.compat.v1.GraphKeys.UPDATE_OPS` (see `layers.batch_norm`).

  Args:
    images: float32 tensor [batch, height, width, 3] with static height and
      width (32x32 for CIFAR-10).
    is_training: Python bool; batch norm uses batch statistics if True and
      moving statistics if False.
    num_classes: number of classes.
    shortcut: "A" (zero-padding identity, the paper's CIFAR model: no
      parameters) or "B" (projection when the shape changes).
    blocks_per_stage: n, the basic blocks in each of the three stages.
    name: the model's name, in messages and as its variable scope.

  Returns:
    float32 logits [batch, num_classes].

  Raises:
    ValueError: if an argument is invalid.
  """
  layers.check_model_inputs(images, num_classes, name)
  if shortcut not in SHORTCUTS:
    raise ValueError("%s: shortcut must be one of %s, got %r" %
                     (name, SHORTCUTS, shortcut))
  with tf1.variable_scope(name):
    x = _conv_bn(images, STAGE_FILTERS[0], 3, 1, is_training, "initial")
    for stage, filters in enumerate(STAGE_FILTERS):
      for block in range(blocks_per_stage):
        strides = 2 if stage > 0 and block == 0 else 1
        x = _basic_block(x, filters, strides, is_training, shortcut,
                         "stage%d/block%d" % (stage + 1, block + 1))
    x = tf.reduce_mean(x, axis=[1, 2], name="global_avg_pool")
    return layers.dense(x, num_classes, "logits")
