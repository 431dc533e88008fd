"""One tower's loss and gradients: input -> model (in its precision) ->
loss -> loss scale -> gradients -> drill (the first module of a gradient's
path through the trainer's step, `train_step`)."""

import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train.core import tower_outliers
from tf1_safe_train.trainer.step import optimization
from tf1_safe_train.trainer.step import precision

tf1 = tf.compat.v1


def tower_loss_and_grads(params, images, labels, model_fn, optimizer,
                         tower_drill, loss_scale=None, scale=None):
  """One tower's loss, (float32, unscaled) gradients and gauge.

  `images` are as the model reads them (after the input drill, which models
  data: the batch store and a replay see the poisoned batch).

  With --precision=fp16|bf16 the tower computes in that dtype on float32
  master weights; with a `loss_scale` it differentiates the loss times
  `scale` and divides the gradients back (`DynamicLossScale.gradients`).
  """
  compute_dtype = precision.compute_dtype(params.precision)
  if compute_dtype == tf.float32:
    logits = model_fn(images, is_training=True, num_classes=data.NUM_CLASSES)
  else:
    with precision.float32_master_weights():
      logits = model_fn(tf.cast(images, compute_dtype), is_training=True,
                        num_classes=data.NUM_CLASSES)
    logits = tf.cast(logits, tf.float32)
  per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(labels, tf.int32), logits=logits)
  cross_entropy = tf.reduce_mean(per_example)
  decay = optimization.weight_decay_loss(params.weight_decay)
  loss = cross_entropy + decay if decay is not None else cross_entropy

  built = []  # Once: the step's criterion and an outlier's replay share it.

  def gauge():
    if built:
      return built[0]
    with tf1.colocate_with(logits.op):
      output = _output_grad_norm(per_example, cross_entropy, logits)
      # decay = wd * |w|^2 / 2, so its gradient wd * w has the norm
      # sqrt(2 * wd * decay): no pass over the weights.
      shared = (tf.sqrt(tf.maximum(decay, 0.0) *
                        (2.0 * params.weight_decay))
                if decay is not None else tf.constant(0.0))
    built.append((output, shared))
    return built[0]

  loss = tower_drill.loss(loss)
  kwargs = dict(var_list=tf1.trainable_variables(),
                colocate_gradients_with_ops=True)
  if loss_scale is None:
    grads_and_vars = optimizer.compute_gradients(loss, **kwargs)
  else:
    grads_and_vars = loss_scale.gradients(optimizer.compute_gradients, loss,
                                          scale, **kwargs)
  return loss, tower_drill.grads(grads_and_vars), gauge


def _output_grad_norm(per_example, cross_entropy, logits):
  """The mean cross-entropy's gradient norm at the logits, up to a factor
  shared by every tower (the criterion reads ratios between towers of one
  batch size): sqrt(|softmax - one-hot|^2 / 2). The cross-entropy op
  computes softmax - one-hot anyway (its second output, which its gradient
  reuses): two nodes a good step, not a gradient's."""
  op = per_example.op
  if op.type != "SparseSoftmaxCrossEntropyWithLogits":
    return tower_outliers.output_grad_norm(cross_entropy, logits)
  return tf.sqrt(tf.nn.l2_loss(op.outputs[1]))
