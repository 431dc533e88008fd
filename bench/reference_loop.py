"""The loop a user would run instead of `//:train`: tf_cnn_benchmarks' shape.

Written after tf_cnn_benchmarks' `benchmark_cnn.py` (synthetic data,
`variable_mgr.py`), not copied from it: each tower's images are a local
variable filled once with a truncated normal (`get_synthetic_inputs`: no
input pipeline, nothing made per step), its labels drawn in the graph per
step; one `session.run` of the train op and the average loss per step, no
hooks, no summaries, no checkpoints. Variables are either replicated (one
copy per tower, `v<i>/`, the gradients summed on the CPU, each tower applying
its own copy: `--variable_update=replicated` with its default
`CopyToDeviceAlgorithm(['/cpu:0'])`) or on the parameter device
(`parameter_server`: one copy on /cpu:0, gradients averaged there), with the
trainer's model, loss, weight decay and optimizer.
"""

import collections

import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train import models
from tf1_safe_train.trainer.step import optimization
from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1

REPLICATED = "replicated"
PARAMETER_SERVER = "parameter_server"
VARIABLE_UPDATES = (REPLICATED, PARAMETER_SERVER)
_PARAMETER_DEVICE = "/device:CPU:0"

Reference = collections.namedtuple("Reference", ["session", "fetches"])


def _synthetic_inputs(batch_size):
  """A tower's (images, labels), as `get_synthetic_inputs` makes them."""
  # Unit scale (tf_cnn_benchmarks' are mean 127, stddev 60, made for models
  # that normalise): the same cost, and a loss that stays finite.
  images = tf1.Variable(
      tf1.truncated_normal([batch_size] + list(data.IMAGE_SHAPE)),
      trainable=False, collections=[tf1.GraphKeys.LOCAL_VARIABLES],
      name="gpu_cached_inputs")
  labels = tf1.random_uniform([batch_size], minval=0,
                              maxval=data.NUM_CLASSES - 1, dtype=tf.int32,
                              name="synthetic_labels")
  return images, labels


def _tower_loss(model_fn, batch_size, weight_decay, variables):
  """One tower's loss on its synthetic batch (weight decay over `variables`)."""
  images, labels = _synthetic_inputs(batch_size)
  logits = model_fn(images, is_training=True, num_classes=data.NUM_CLASSES)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  weights = [v for v in variables() if v.op.name.endswith("weights")]
  if weight_decay and weights:
    loss += weight_decay * tf.add_n([tf.nn.l2_loss(w) for w in weights])
  return loss


def _replicated(config, model_fn, batch_size, weight_decay, learning_rate,
                global_step):
  """(train ops, losses, post-init ops): each tower its own variables."""
  losses, tower_grads = [], []
  for i in range(config.num_towers):
    scope = "v%d" % i
    with tf1.device(config.tower_device(i)), tf1.variable_scope(scope):
      mine = lambda scope=scope: tf1.trainable_variables(scope + "/")
      loss = _tower_loss(model_fn, batch_size, weight_decay, mine)
      variables = mine()
      grads = tf.gradients(loss, variables)
    losses.append(loss)
    tower_grads.append(list(zip(grads, variables)))
  # CopyToDeviceAlgorithm(['/cpu:0']): sum on the CPU, a copy per tower.
  with tf1.device(_PARAMETER_DEVICE), tf1.name_scope("all_reduce"):
    sums = [tf.add_n([g for g, _ in pairs]) * (1.0 / config.num_towers)
            if config.num_towers > 1 else pairs[0][0]
            for pairs in zip(*tower_grads)]
  train_ops = []
  for i, pairs in enumerate(tower_grads):
    with tf1.device(config.tower_device(i)):
      optimizer = optimization.make_optimizer("momentum", learning_rate)
      train_ops.append(optimizer.apply_gradients(
          [(tf.identity(s), v) for s, (_, v) in zip(sums, pairs)],
          global_step=global_step if i == 0 else None))
  # Every copy starts as tower 0's (`get_post_init_ops`).
  post_init = [v.assign(v0) for pairs in tower_grads[1:]
               for (_, v), (_, v0) in zip(pairs, tower_grads[0])]
  return train_ops, losses, post_init


def _parameter_server(config, model_fn, batch_size, weight_decay,
                      learning_rate, global_step):
  """(train ops, losses, post-init ops): one copy of the variables on the
  CPU, the gradients averaged there (as `towers.average_gradients`)."""
  losses, tower_grads = [], []
  for i in range(config.num_towers):
    with tf1.device(config.tower_device_fn(i)), \
        tf1.variable_scope("v", reuse=True if i else None):
      loss = _tower_loss(model_fn, batch_size, weight_decay,
                         lambda: tf1.trainable_variables("v/"))
      variables = tf1.trainable_variables("v/")
      losses.append(loss)
      tower_grads.append(list(zip(tf.gradients(loss, variables), variables)))
  with tf1.device(_PARAMETER_DEVICE):
    pairs = towers.average_gradients(tower_grads)
    optimizer = optimization.make_optimizer("momentum", learning_rate)
    return [optimizer.apply_gradients(pairs, global_step=global_step)], \
        losses, []


def build(model, num_towers, batch_size, variable_update=REPLICATED,
          weight_decay=1e-4, learning_rate=0.01, seed=0):
  """The reference loop's graph and session, initialised.

  Args:
    model: a model name (`models.get_model`).
    num_towers: towers, each on its own virtual CPU device.
    batch_size: examples per tower per step.
    variable_update: one of `VARIABLE_UPDATES`.
    weight_decay: L2 rate on the weights (the trainer's default).
    learning_rate: the momentum optimizer's constant rate.
    seed: graph-level seed.

  Returns:
    A `Reference`: its session, and the fetches of one step.

  Raises:
    ValueError: for an unknown `variable_update`.
  """
  if variable_update not in VARIABLE_UPDATES:
    raise ValueError("variable_update must be one of %s, got %r" %
                     (", ".join(VARIABLE_UPDATES), variable_update))
  config = towers.TowerConfig(num_towers, "cpu")
  model_fn = models.get_model(model)
  graph = tf.Graph()
  with graph.as_default():
    tf1.set_random_seed(seed)
    with tf1.device(_PARAMETER_DEVICE):
      global_step = tf1.train.get_or_create_global_step()
    build_fn = (_replicated if variable_update == REPLICATED
                else _parameter_server)
    train_ops, losses, post_init = build_fn(
        config, model_fn, batch_size, weight_decay, learning_rate,
        global_step)
    # Batch-norm statistics from the first tower, as tf_cnn_benchmarks.
    update_ops = tf1.get_collection(
        tf1.GraphKeys.UPDATE_OPS,
        "v0/" if variable_update == REPLICATED else "v/")
    with tf1.device(_PARAMETER_DEVICE), tf1.name_scope("average_loss"):
      average_loss = tf.reduce_mean(losses)
    train_op = tf.group(*(train_ops + update_ops), name="train_ops_group")
    init = [tf1.global_variables_initializer(),
            tf1.local_variables_initializer()]
    post_init = tf.group(*post_init)
  graph.finalize()
  session = tf1.Session(graph=graph, config=towers.session_config(config))
  session.run(init)
  session.run(post_init)
  return Reference(session, {"train_op": train_op,
                             "average_loss": average_loss})
