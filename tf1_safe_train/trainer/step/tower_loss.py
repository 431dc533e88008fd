"""One tower's loss and gradients: input -> model (in its precision) ->
loss -> loss scale -> gradients -> drill (the first module of a gradient's
path through the trainer's step, `train_step`)."""

import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train.trainer.step import optimization
from tf1_safe_train.trainer.step import precision

tf1 = tf.compat.v1


def tower_loss_and_grads(params, images, labels, model_fn, optimizer,
                         tower_drill, loss_scale=None, scale=None):
  """One tower's loss and (float32, unscaled) gradients.

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
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=tf.cast(labels, tf.int32), logits=logits))
  decay = optimization.weight_decay_loss(params.weight_decay)
  if decay is not None:
    loss += decay
  loss = tower_drill.loss(loss)
  kwargs = dict(var_list=tf1.trainable_variables(),
                colocate_gradients_with_ops=True)
  if loss_scale is None:
    grads_and_vars = optimizer.compute_gradients(loss, **kwargs)
  else:
    grads_and_vars = loss_scale.gradients(optimizer.compute_gradients, loss,
                                          scale, **kwargs)
  return loss, tower_drill.grads(grads_and_vars)
