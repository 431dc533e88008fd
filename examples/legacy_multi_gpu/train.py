"""Multi-tower training written the way TF1 scripts were in 2017-2019.

In the spirit of cifar10_multi_gpu_train.py: `tf.compat.v1.layers` with batch
norm, one tower per device (`tf.device('/cpu:%d' % i)` here: virtual CPUs
stand in for GPUs) with the variables on /cpu:0, averaged tower gradients,
the first tower's `UPDATE_OPS` under `control_dependencies`, an
`ExponentialMovingAverage` grouped into the train op, and a
`MonitoredTrainingSession`.

`train_legacy.py` is the original; `train.py` is the same file migrated to
tf1_safe_train, and the two differ by an import and two lines (README.md).
`--nan_step` turns one tower's batch into NaN at one step, as a corrupt record
or an overflowing augmentation would:

  TF_USE_LEGACY_KERAS=1 PYTHONPATH=. python \
      examples/legacy_multi_gpu/train_legacy.py --max_steps=20 --nan_step=10
"""

import argparse
import collections
import os
import sys
import time

# TF >= 2.16 ships Keras 3, which has no tf.compat.v1.layers; Keras 2
# (pip install tf-keras) provides them if this is set before TF loads.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position
import tf1_safe_train  # pylint: disable=wrong-import-position

tf1 = tf.compat.v1

IMAGE_SIZE = 16
NUM_CLASSES = 10
INITIAL_LEARNING_RATE = 0.05
NUM_STEPS_PER_DECAY = 1000
LEARNING_RATE_DECAY_FACTOR = 0.1
MOVING_AVERAGE_DECAY = 0.999
WEIGHT_DECAY = 1e-4
TOWER_NAME = "tower"

Model = collections.namedtuple("Model", [
    "train_op", "loss", "global_step", "optimizer", "variable_averages",
    "update_ops", "tower_losses"])


def inputs(tower, batch_size, global_step, nan_step=-1, nan_tower=-1):
  """Synthetic, learnable CIFAR-like batches: a class pattern plus noise."""
  patterns = np.random.RandomState(0).normal(
      size=[NUM_CLASSES, IMAGE_SIZE, IMAGE_SIZE, 3]).astype(np.float32)
  labels = tf.random.uniform([batch_size], 0, NUM_CLASSES, dtype=tf.int32,
                             seed=2 * tower + 1)
  noise = tf.random.normal([batch_size, IMAGE_SIZE, IMAGE_SIZE, 3],
                           seed=2 * tower + 2)
  images = tf.gather(tf.constant(patterns), labels) + noise
  if tower == nan_tower:
    # Fault injection for the demo: this tower's batch is NaN at nan_step.
    poisoned = tf.equal(global_step.read_value(), nan_step)
    images *= tf1.where(poisoned, np.float32(np.nan), np.float32(1.0))
  return images, labels


def inference(images):
  """conv-bn-relu-pool, conv-bn-relu, global average pool, dense."""
  net = tf1.layers.conv2d(images, 16, 3, padding="same", use_bias=False,
                          name="conv1")
  net = tf1.layers.batch_normalization(net, training=True, name="bn1")
  net = tf.nn.relu(net)
  net = tf1.layers.max_pooling2d(net, 2, 2, name="pool1")
  net = tf1.layers.conv2d(net, 32, 3, padding="same", use_bias=False,
                          name="conv2")
  net = tf1.layers.batch_normalization(net, training=True, name="bn2")
  net = tf.nn.relu(net)
  net = tf.reduce_mean(net, [1, 2])
  return tf1.layers.dense(net, NUM_CLASSES, name="logits")


def tower_loss(scope, images, labels):
  """Cross entropy plus weight decay, summed from this tower's 'losses'."""
  logits = inference(images)
  cross_entropy = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                     logits=logits),
      name="cross_entropy")
  tf1.add_to_collection("losses", cross_entropy)
  kernels = [v for v in tf1.trainable_variables() if "kernel" in v.op.name]
  tf1.add_to_collection(
      "losses", tf.multiply(WEIGHT_DECAY, tf.add_n(
          [tf.nn.l2_loss(k) for k in kernels]), name="weight_loss"))
  return tf.add_n(tf1.get_collection("losses", scope), name="total_loss")


def average_gradients(tower_grads):
  """The mean over towers of each variable's gradient."""
  average_grads = []
  for grad_and_vars in zip(*tower_grads):
    grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
    grad = tf.reduce_mean(tf.concat(grads, 0), 0)
    average_grads.append((grad, grad_and_vars[0][1]))
  return average_grads


def _variables_on_cpu(getter, *args, **kwargs):
  """Custom getter: every variable lives on /cpu:0, shared by the towers."""
  with tf.device("/cpu:0"):
    return getter(*args, **kwargs)


def build_model(num_towers=2, batch_size=8, nan_step=-1, nan_tower=-1):
  """Builds the towers and the train op in the default graph."""
  with tf.device("/cpu:0"):
    global_step = tf1.train.get_or_create_global_step()
    lr = tf1.train.exponential_decay(INITIAL_LEARNING_RATE, global_step,
                                     NUM_STEPS_PER_DECAY,
                                     LEARNING_RATE_DECAY_FACTOR,
                                     staircase=True)
    opt = tf1.train.MomentumOptimizer(lr, 0.9)
    opt = tf1_safe_train.SkipNonFiniteOptimizer(opt)

    tower_grads = []
    tower_losses = []
    with tf1.variable_scope(tf1.get_variable_scope(),
                            custom_getter=_variables_on_cpu):
      for i in range(num_towers):
        with tf.device("/cpu:%d" % i):
          with tf1.name_scope("%s_%d" % (TOWER_NAME, i)) as scope:
            images, labels = inputs(i, batch_size, global_step, nan_step,
                                    nan_tower)
            loss = tower_loss(scope, images, labels)
            tf1.get_variable_scope().reuse_variables()
            # Batch-norm statistics come from the first tower only.
            if i == 0:
              update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, scope)
            tower_grads.append(opt.compute_gradients(loss))
            tower_losses.append(loss)

    grads = average_gradients(tower_grads)
    with tf1.control_dependencies(update_ops):
      apply_gradient_op = opt.apply_gradients(grads, global_step=global_step)

    variable_averages = tf1.train.ExponentialMovingAverage(
        MOVING_AVERAGE_DECAY, global_step)
    with tf1.control_dependencies([apply_gradient_op]):
      variables_averages_op = variable_averages.apply(
          tf1.trainable_variables())

    train_op = tf.group(apply_gradient_op, variables_averages_op)
    train_op = opt.protect(train_op)
    loss = tf.add_n(tower_losses) / float(num_towers)
  return Model(train_op, loss, global_step, opt, variable_averages,
               update_ops, tower_losses)


class _LoggerHook(tf1.train.SessionRunHook):
  """Logs loss and runtime, and keeps every step's loss."""

  def __init__(self, loss, batch_size, log_frequency):
    self._loss = loss
    self._batch_size = batch_size
    self._log_frequency = log_frequency
    self.losses = []

  def begin(self):
    self._step = -1
    self._start_time = time.time()

  def before_run(self, run_context):
    self._step += 1
    return tf1.train.SessionRunArgs(self._loss)

  def after_run(self, run_context, run_values):
    step, loss_value = self._step, run_values.results
    self.losses.append(float(loss_value))
    if (step + 1) % self._log_frequency == 0:
      duration = time.time() - self._start_time
      self._start_time = time.time()
      print("step %d, loss = %.3f (%.1f examples/sec)" % (
          step, loss_value,
          self._log_frequency * self._batch_size / max(duration, 1e-9)))


def train(train_dir, max_steps, num_towers=2, batch_size=8, nan_step=-1,
          nan_tower=1, log_frequency=10, seed=0):
  """Trains for max_steps; returns the loss of every step."""
  with tf.Graph().as_default():
    # Python's, NumPy's and the graph's seeds: Keras 2 initializers draw
    # their seeds from Python's `random`.
    tf.keras.utils.set_random_seed(seed)
    model = build_model(num_towers, batch_size, nan_step, nan_tower)
    logger = _LoggerHook(model.loss, num_towers * batch_size, log_frequency)
    config = tf1.ConfigProto(device_count={"CPU": num_towers},
                             allow_soft_placement=True)
    with tf1.train.MonitoredTrainingSession(
        checkpoint_dir=train_dir,
        hooks=[tf1.train.StopAtStepHook(last_step=max_steps), logger],
        config=config) as mon_sess:
      while not mon_sess.should_stop():
        mon_sess.run(model.train_op)
  return logger.losses


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--train_dir", default="/tmp/legacy_multi_gpu_train",
                      help="Checkpoints go here; training resumes from it.")
  parser.add_argument("--max_steps", type=int, default=100,
                      help="Stop at this global step.")
  parser.add_argument("--num_towers", type=int, default=2,
                      help="Towers, one per (virtual CPU) device.")
  parser.add_argument("--batch_size", type=int, default=8,
                      help="Examples per tower per step.")
  parser.add_argument("--nan_step", type=int, default=-1,
                      help="Global step whose batch turns NaN; -1: none.")
  parser.add_argument("--nan_tower", type=int, default=1,
                      help="The tower whose batch turns NaN at --nan_step.")
  parser.add_argument("--log_frequency", type=int, default=10,
                      help="Log every this many steps.")
  parser.add_argument("--seed", type=int, default=0,
                      help="Seed of the initial weights and the data.")
  args = parser.parse_args(argv[1:])
  train(args.train_dir, args.max_steps, args.num_towers, args.batch_size,
        args.nan_step, args.nan_tower, args.log_frequency, args.seed)


if __name__ == "__main__":
  main(sys.argv)
