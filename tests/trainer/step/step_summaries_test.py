"""The skip counters' TensorBoard hook costs a good step nothing.

Issue #37: "TensorBoard counters written on every step whose counters
changed ..., with no executed node added to a good step that writes
nothing". `CountersHook` fetches the tensors the run's `RunStatsHook`
fetches anyway and writes from Python: a good step's executed nodes, traced
(`bench/executed_ops.py`), are the same with it as without it.
"""

from unittest import mock

import numpy as np
import tensorflow as tf

from bench import executed_ops
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import hooks as hooks_lib
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.step import step_summaries
from tf1_safe_train.trainer.step import train_step
from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1

_STEPS = 4


def _linear_model(unused_name):
  def model_fn(images, is_training, num_classes):
    del is_training
    with tf1.variable_scope("model", reuse=tf1.AUTO_REUSE):
      w = tf1.get_variable("w", [48, num_classes],
                           initializer=tf1.zeros_initializer())
    return tf.matmul(tf.reshape(images, [-1, 48]), w)
  return model_fn


def _dataset(unused_batch_size, unused_seed):
  images = np.ones([2, 4, 4, 3], np.float32)
  labels = np.zeros([2], np.int32)
  return tf.data.Dataset.from_tensors((images, labels)).repeat()


class _Trace(tf1.train.SessionRunHook):
  """Traces every run; `nodes` holds each run's executed nodes."""

  def __init__(self):
    self.nodes = []

  def before_run(self, run_context):
    return tf1.train.SessionRunArgs(None, options=tf1.RunOptions(
        trace_level=tf1.RunOptions.FULL_TRACE))

  def after_run(self, run_context, run_values):
    self.nodes.append(sum(executed_ops.executed_by_device(
        run_values.run_metadata).values()))


def _good_steps(summary_dir, with_counters):
  """(executed nodes of each good step, points the CountersHook had
  written before the session's end, or None without it)."""
  params = params_lib.TrainParams(
      train_dir=summary_dir, num_towers=2, device="cpu", batch_size=2,
      optimizer="sgd", weight_decay=0.0).validate()
  config = towers.TowerConfig(2, "cpu")
  with tf.Graph().as_default():
    with mock.patch.object(train_step.models, "get_model", _linear_model):
      step = train_step.build_step(
          params, local_replication.Local(params, config),
          dataset_fn=_dataset)
    trace = _Trace()
    # The run's hook that fetches the totals (train_lib's `stats`).
    hooks = [hooks_lib.RunStatsHook(dict(step.totals, loss=step.loss)),
             trace]
    counters = None
    if with_counters:
      counters = step_summaries.CountersHook(step, summary_dir, 100)
      hooks.append(counters)
    points = None
    with tf1.train.MonitoredSession(
        session_creator=tf1.train.ChiefSessionCreator(
            config=towers.session_config(config)), hooks=hooks) as sess:
      for _ in range(_STEPS):
        sess.run(step.train_op)
      if counters is not None:
        points = counters.points
    # The first run also initialises what runs once.
    return trace.nodes[1:], points


class CountersHookCostTest(tf.test.TestCase):

  def testAGoodStepThatWritesNothingExecutesNoNodeMore(self):
    without, _ = _good_steps(self.get_temp_dir() + "/without", False)
    with_hook, points = _good_steps(self.get_temp_dir() + "/with", True)
    # The hook wrote its first point only: the good steps after it wrote
    # nothing (applied_steps alone changed).
    self.assertEqual(points, 1)
    self.assertLen(set(without), 1, without)  # Deterministic per step.
    self.assertEqual(with_hook, without)


if __name__ == "__main__":
  tf.test.main()
