"""The worker unit's aggregation (`worker_unit`), in one process.

Three "workers" (three `SummingSyncReplicasOptimizer`s sharing their
accumulators and token queue by name, as a cluster's do) push into one
session, then the chief's queue-runner op applies the aggregate once. With
worker 1 poisoned, the step applies the average of workers 0 and 2 bit for
bit, whatever the order the pushes arrive in; with every worker poisoned
the step is skipped, and nothing moves but the counters.
"""

import tempfile

import numpy as np
import tensorflow as tf

from tf1_safe_train.cluster import worker_unit
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import loss_scale as loss_scale_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_NUM_WORKERS = 3
# Gradients whose MEAN-then-rescale, (a + b + 0) / 3 * 3 / 2, is not
# (a + b) / 2 in float32 (checked below): the test would see a MEAN.
_A = np.array([0.1, 1.7, -2.3, 1e-3], np.float32)
_B = np.array([0.7, 0.3, 1.1, 3.3], np.float32)
_LR = 0.1


class _Cluster(object):
  """The graph: each worker's push (and token) op, the chief's apply."""

  def __init__(self, min_healthy=2, loss_scale=False):
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.global_step = tf1.train.get_or_create_global_step()
      self.weights = tf1.Variable(np.ones(4, np.float32), name="w")
      self.grads = [tf1.placeholder(tf.float32, [4]) for _ in range(3)]
      self.pushes, self.sync = [], None
      for worker in range(_NUM_WORKERS):
        with tf1.name_scope("worker_%d" % worker):
          unit = worker_unit.WorkerUnit(_NUM_WORKERS, worker, min_healthy,
                                        "/cpu:0")
          if worker == 0:  # One scale (the chief's decision's).
            scale = (loss_scale_lib.DynamicLossScale(initial_scale=1024.0)
                     if loss_scale else None)
          guarded = optimizer_lib.SkipNonFiniteOptimizer(
              tf1.train.GradientDescentOptimizer(_LR), check_runs=False,
              tower_unit=unit, name="guarded_%d" % worker, loss_scale=scale)
          grad = self.grads[worker]
          pairs, _ = unit.contribution(
              [(grad, self.weights)],
              tf.logical_not(tf.reduce_all(tf.math.is_finite(grad))),
              self.global_step)
          sync = worker_unit.SummingSyncReplicasOptimizer(
              worker_unit.HealthyAverage(guarded, unit),
              replicas_to_aggregate=_NUM_WORKERS,
              total_num_replicas=_NUM_WORKERS)
          self.pushes.append(sync.apply_gradients(pairs, self.global_step))
          sync.ready_for_local_init_op.mark_used()  # (No session hook.)
        if worker == 0:
          self.sync, self.unit, self.scale = sync, unit, scale
      self.counters = counters_lib.skip_counters()
      self.chief_apply = self.sync.get_chief_queue_runner().enqueue_ops[0]
      self.init = [tf1.global_variables_initializer(),
                   tf1.local_variables_initializer()]

  def step(self, grads, order=(0, 1, 2)):
    """Runs one step: each worker's push in `order`, then the chief's
    apply; returns (weights, skipped_steps, rejected_by_worker)."""
    with tf1.Session(graph=self.graph) as session:
      session.run(self.init)
      session.run([self.sync.chief_init_op,
                   self.sync.get_init_tokens_op()])
      feed = dict(zip(self.grads, grads))
      for worker in order:
        session.run(self.pushes[worker], feed)
      session.run(self.chief_apply)
      self.scale_after = (session.run(self.scale.scale())
                          if self.scale else None)
      return session.run([self.weights, self.counters.skipped_steps,
                          self.unit.rejected])


class WorkerUnitTest(tf.test.TestCase):

  def _reference(self):
    """SGD of (a + b) / 2, applied by TF's own op."""
    with tf.Graph().as_default(), tf1.Session() as session:
      weights = tf1.Variable(np.ones(4, np.float32))
      apply = tf1.train.GradientDescentOptimizer(_LR).apply_gradients(
          [((tf.constant(_A) + tf.constant(_B)) / 2.0, weights)])
      session.run(tf1.global_variables_initializer())
      session.run(apply)
      return session.run(weights)

  def testAMeanWouldNotBeTheAverage(self):
    # The test's teeth: TF's MEAN accumulators, rescaled, differ here.
    rescaled = (_A + _B + np.float32(0)) / np.float32(3) * np.float32(
        3) / np.float32(2)
    self.assertFalse(np.array_equal(rescaled, (_A + _B) / np.float32(2)))

  def testLeavesOutThePoisonedWorkerBitForBitInEveryOrder(self):
    cluster = _Cluster()
    poisoned = np.full(4, np.nan, np.float32)
    reference = self._reference()
    for order in ((0, 1, 2), (1, 0, 2), (2, 1, 0), (0, 2, 1)):
      weights, skipped, rejected = cluster.step([_A, poisoned, _B], order)
      self.assertAllEqual(weights, reference, msg=str(order))
      self.assertEqual(skipped, 0)
      self.assertAllEqual(rejected, [0, 1, 0])

  def testSkipsTheStepWhenTooFewAreHealthy(self):
    cluster = _Cluster()
    poisoned = np.full(4, np.nan, np.float32)
    weights, skipped, rejected = cluster.step([poisoned] * 3)
    self.assertAllEqual(weights, np.ones(4, np.float32))
    self.assertEqual(skipped, 1)
    self.assertAllEqual(rejected, [0, 0, 0])
    # One healthy worker of three is below the floor (2) as well.
    weights, skipped, _ = cluster.step([_A, poisoned, poisoned])
    self.assertAllEqual(weights, np.ones(4, np.float32))
    self.assertEqual(skipped, 1)

  def testALeftOutWorkerHalvesTheLossScale(self):
    # As a left-out tower does (an overflow of one replica is an overflow).
    cluster = _Cluster(loss_scale=True)
    poisoned = np.full(4, np.nan, np.float32)
    _, skipped, _ = cluster.step([_A, poisoned, _B])
    self.assertEqual((skipped, cluster.scale_after), (0, 512.0))
    _, skipped, _ = cluster.step([_A, _B, _B])
    self.assertEqual((skipped, cluster.scale_after), (0, 1024.0))

  def testAllHealthyIsTheMean(self):
    cluster = _Cluster()
    weights, skipped, rejected = cluster.step([_A, _B, _B])
    expected = np.ones(4, np.float32) - np.float32(_LR) * (
        (_A + _B + _B) / np.float32(3))
    self.assertAllClose(weights, expected)
    self.assertEqual(skipped, 0)
    self.assertAllEqual(rejected, [0, 0, 0])


  def testRefusedOnOneMachineInOneLine(self):
    params = params_lib.TrainParams(
        train_dir=tempfile.mkdtemp(dir=self.get_temp_dir()),
        skip_unit="worker",
        sync_replicas=True)
    with self.assertRaisesRegex(params_lib.ParamsError,
                                "--skip_unit=worker runs in a cluster only"):
      train_lib.train(params)


if __name__ == "__main__":
  tf.test.main()
