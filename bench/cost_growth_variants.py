"""The steps `cost_growth` compares, built for a workload and a tower count.

A workload is a model and its fixed batch: `dense<V>` (a stack of V small
dense layers: V variables, 16x16 weights each and a 16x10 classifier, tanh
in between, on 16 features per example) or a reference model (`small_cnn`,
`resnet20`, on 32x32x3 images). Every variant runs the same towers, one per
virtual CPU device (`/device:CPU:i`), variables on `/device:CPU:0`, each
tower taking its own batch from one iterator over the fixed batch; the
towers' gradients are averaged (`towers.average_gradients`) and applied with
momentum, after the first tower's `UPDATE_OPS` (the legacy multi-tower
idiom). Only what decides and applies the update differs.
"""

import collections
from unittest import mock

import numpy as np
import tensorflow as tf

from bench import guard_overhead_lib
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train import models
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

# The timed variants, in the table's order (the timing shuffles them).
VARIANTS = ("plain", "skip_nonfinite_optimizer", "guarded_trainer_step",
            "loss_scale_optimizer", "barrier_only")
CONTROL = "plain_control"
LABELS = {
    "plain": "plain apply_gradients",
    "skip_nonfinite_optimizer": "SkipNonFiniteOptimizer",
    "guarded_trainer_step": "trainer's guarded step",
    "loss_scale_optimizer": "TF MixedPrecisionLossScaleOptimizer (dynamic)",
    "barrier_only": "barrier + cond on a True variable (design floor)",
    "plain_control": "plain again (A/A control)",
}
DENSE_PREFIX = "dense"
DENSE_WIDTH = 16
BATCH_SIZE = 32

Built = collections.namedtuple("Built", ["session", "train_op",
                                         "all_steps_applied", "variables"])
Built.__doc__ = """One variant, built in its own graph and session.

Attributes:
  session: its session (variables initialised, graph finalized).
  train_op: what one step runs.
  all_steps_applied: callable: True if no step so far was skipped, False if
    one was, None for variants that cannot skip.
  variables: the number of trainable variables (gradients per tower).
"""


def dense_variables(workload):
  """V of `dense<V>`, or None for a reference model's name."""
  if workload.startswith(DENSE_PREFIX):
    suffix = workload[len(DENSE_PREFIX):]
    if suffix.isdigit() and int(suffix) >= 1:
      return int(suffix)
  return None


def dense_stack(num_variables):
  """A model function: `num_variables` dense layers, one weight each."""

  def model_fn(images, is_training, num_classes=10):
    del is_training  # Nothing behaves differently in training.
    x = tf.reshape(images, [-1, DENSE_WIDTH])
    with tf1.variable_scope("dense_stack"):
      for i in range(num_variables - 1):
        w = tf1.get_variable("layer%d/weights" % i, [DENSE_WIDTH, DENSE_WIDTH])
        x = tf.tanh(tf.matmul(x, w))
      w = tf1.get_variable("logits/weights", [DENSE_WIDTH, num_classes])
    return tf.matmul(x, w)

  return model_fn


def model_fn(workload):
  """The model function of `workload`."""
  num_variables = dense_variables(workload)
  if num_variables is not None:
    return dense_stack(num_variables)
  return models.get_model(workload)


def fixed_batch(workload, seed=0):
  """The workload's fixed batch: (float32 images, int32 labels) arrays."""
  if dense_variables(workload) is None:
    return guard_overhead_lib.fixed_batch(BATCH_SIZE, seed)
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((BATCH_SIZE, DENSE_WIDTH)).astype(np.float32),
          rng.integers(0, 10, BATCH_SIZE).astype(np.int32))


def _dataset(images, labels):
  # The same in-memory batch every step: no input cost hides the step's.
  return tf.data.Dataset.from_tensors((images, labels)).repeat()


def _dataset_with_ids(images, labels):
  # With an id feature, as the trainer's own datasets have: a pipeline
  # without one pays a content hash per example (forensics' cost, measured
  # by guard_overhead), not the decision's.
  ids = np.arange(len(images), dtype=np.int64)
  return tf.data.Dataset.from_tensors((images, labels, ids)).repeat()


def _momentum():
  return tf1.train.MomentumOptimizer(0.01, momentum=guard_overhead_lib.MOMENTUM)


def _tower_gradients(workload, config, images, labels, compute_gradients):
  """Builds the towers; returns (averaged pairs, tower 0's update ops)."""
  with tf.device("/device:CPU:0"), tf1.name_scope("input"):
    iterator = tf1.data.make_one_shot_iterator(_dataset(images, labels))
  model = model_fn(workload)

  def tower(unused_index):
    tower_images, tower_labels = iterator.get_next()
    logits = model(tower_images, is_training=True, num_classes=10)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tower_labels, logits=logits))
    return compute_gradients(loss, colocate_gradients_with_ops=True)

  grads = towers.average_gradients(towers.build_towers(config, tower))
  return grads, tf1.get_collection(tf1.GraphKeys.UPDATE_OPS,
                                   config.tower_scope(0))


def _no_skips():
  return lambda: tf.equal(counters_lib.skip_counters().skipped_steps, 0)


# Each `_build_*(workload, config, images, labels)` builds one variant in the
# default graph and returns (train op, a callable building the bool tensor
# that is True while no step was skipped, or None).


def _build_plain(workload, config, images, labels):
  global_step = tf1.train.get_or_create_global_step()
  opt = _momentum()
  grads, update_ops = _tower_gradients(workload, config, images, labels,
                                       opt.compute_gradients)
  with tf1.control_dependencies(update_ops):
    return opt.apply_gradients(grads, global_step=global_step), None


def _build_wrapper(workload, config, images, labels):
  global_step = tf1.train.get_or_create_global_step()
  opt = optimizer_lib.SkipNonFiniteOptimizer(_momentum())
  grads, update_ops = _tower_gradients(workload, config, images, labels,
                                       opt.compute_gradients)
  with tf1.control_dependencies(update_ops):
    return opt.apply_gradients(grads, global_step=global_step), _no_skips()


def _build_trainer(workload, config, images, labels):
  """`train_step.build_step`, the trainer's own step, on `config`."""
  params = params_lib.TrainParams(
      # A dense stack is swapped in for the model below; the name only
      # passes validation.
      model=workload if dense_variables(workload) is None else "small_cnn",
      num_towers=config.num_towers, device="cpu", batch_size=len(images),
      optimizer="momentum", learning_rate=0.01,
      # The other variants' loss is the cross-entropy alone.
      weight_decay=0.0).validate()
  # The trainer builds registered models only; the dense stack goes in
  # through the lookup it calls (the variable count is checked after).
  fn = model_fn(workload)
  with mock.patch.object(train_step.models, "get_model",
                         lambda unused_name: fn):
    step = train_step.build_step(
        params, local_replication.Local(params, config),
        dataset_fn=lambda unused_batch, unused_seed: _dataset_with_ids(
            images, labels))
  return step.train_op, _no_skips()


def _build_loss_scale(workload, config, images, labels):
  global_step = tf1.train.get_or_create_global_step()
  loss_scale = tf1.mixed_precision.DynamicLossScale()
  opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(_momentum(),
                                                             loss_scale)
  grads, update_ops = _tower_gradients(workload, config, images, labels,
                                       opt.compute_gradients)
  with tf1.control_dependencies(update_ops):
    train_op = opt.apply_gradients(grads, global_step=global_step)
  # A skip halves the scale, which grows back only after 2000 good steps.
  initial = loss_scale.initial_loss_scale
  return train_op, lambda: tf.equal(loss_scale(), initial)


def _build_barrier(workload, config, images, labels):
  """Plain, behind every gradient and a cond that always applies.

  The predicate is read from a variable holding True (a constant one would
  be folded away by Grappler) after every gradient and update op, so no
  update starts before the last gradient: what any all-or-nothing decision
  costs, with no check at all.
  """
  global_step = tf1.train.get_or_create_global_step()
  opt = _momentum()
  grads, update_ops = _tower_gradients(workload, config, images, labels,
                                       opt.compute_gradients)
  with tf.device(config.variables_device()):
    go = tf1.Variable(True, trainable=False, name="always_true")
    barrier = [g.op if isinstance(g, tf.Tensor) else g.values.op
               for g, _ in grads if g is not None]
    with tf1.control_dependencies(barrier + list(update_ops)):
      predicate = go.read_value()

    def apply():
      with tf1.control_dependencies(
          [opt.apply_gradients(grads, global_step=global_step)]):
        return tf.constant(True)

    applied = tf.cond(predicate, apply, lambda: tf.constant(False))
  return applied.op, None


_BUILDERS = {
    "plain": _build_plain,
    "skip_nonfinite_optimizer": _build_wrapper,
    "guarded_trainer_step": _build_trainer,
    "loss_scale_optimizer": _build_loss_scale,
    "barrier_only": _build_barrier,
    "plain_control": _build_plain,
}


def build(name, workload, num_towers, seed=0):
  """Builds variant `name` of `workload` on `num_towers` CPU towers.

  Args:
    name: one of `VARIANTS` or `CONTROL`.
    workload: `dense<V>` or a model name.
    num_towers: towers, each on its own virtual CPU device.
    seed: graph-level seed and the batch's.

  Returns:
    A `Built`.

  Raises:
    ValueError: for an unknown variant or workload, or if the step was not
      built on the workload's variables.
  """
  if name not in _BUILDERS:
    raise ValueError("unknown variant %r; expected one of %s" %
                     (name, ", ".join(_BUILDERS)))
  config = towers.TowerConfig(num_towers, "cpu")
  images, labels = fixed_batch(workload, seed)
  graph = tf.Graph()
  with graph.as_default():
    tf1.set_random_seed(seed)
    train_op, no_skips_fn = _BUILDERS[name](workload, config, images, labels)
    no_skips = no_skips_fn() if no_skips_fn else None
    variables = len(tf1.trainable_variables())
    init = tf1.global_variables_initializer()
  expected = dense_variables(workload)
  if expected is not None and variables != expected:
    raise ValueError("%s of %s built %d trainable variables, expected %d" %
                     (name, workload, variables, expected))
  graph.finalize()
  session = tf1.Session(graph=graph, config=towers.session_config(config))
  session.run(init)
  if no_skips is None:
    return Built(session, train_op, lambda: None, variables)
  return Built(session, train_op, lambda: bool(session.run(no_skips)),
               variables)
