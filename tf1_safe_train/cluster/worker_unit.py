"""The worker unit (`--skip_unit=worker`): a sync cluster leaves out a bad worker, not the step.

Each worker decides its own contribution's health before it pushes, and an
unhealthy one pushes zeros (selected, never NaN * 0) and a health count of
0; the accumulators sum, and the chief divides the sum by the healthy count
in its one decision, skipping the step when fewer than `min_healthy`
workers are healthy.

Why a sum: `SyncReplicasOptimizer`'s accumulators average (MEAN) whatever
`take_grad(N)` receives, and (a + b + 0) / 3 * 3 / 2 is not the average of
a and b in floating point. With two healthy workers the sum is a + b
whatever the order (x + 0 is x, and + commutes), so the step applies
(a + b) / 2 bit for bit; with three or more the sum follows the order in
which the pushes arrive (float addition does not associate): not pinned.
"""

import functools
import math

import tensorflow as tf
from tensorflow.python.training import sync_replicas_optimizer

from tf1_safe_train.core import criteria

tf1 = tf.compat.v1

REJECTED = "rejected_by_worker"


def min_healthy(requested, num_workers):
  """The --min_healthy_workers in force: 0 means half, rounded up."""
  return requested or int(math.ceil(num_workers / 2.0))


class _SummingFlowOps(object):
  """`data_flow_ops` as `SyncReplicasOptimizer` sees it here: its
  accumulators sum (`reduction_type="SUM"`) instead of averaging."""

  def __init__(self, module):
    self._module = module
    self.ConditionalAccumulator = functools.partial(  # pylint: disable=invalid-name
        module.ConditionalAccumulator, reduction_type="SUM")
    self.SparseConditionalAccumulator = functools.partial(  # pylint: disable=invalid-name
        module.SparseConditionalAccumulator, reduction_type="SUM")

  def __getattr__(self, name):
    return getattr(self._module, name)


class SummingSyncReplicasOptimizer(tf1.train.SyncReplicasOptimizer):
  """`SyncReplicasOptimizer` whose accumulators sum the pushes.

  TF's `apply_gradients` (frozen in tf.compat.v1) builds its accumulators
  with no reduction argument: its module's `data_flow_ops` is swapped for
  the time of the call only (graph building is single-threaded), so the
  rest of TF's protocol (tokens, staleness, the chief's queue runner) is
  TF's own, unchanged.
  """

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    module = sync_replicas_optimizer
    original = module.data_flow_ops
    module.data_flow_ops = _SummingFlowOps(original)
    try:
      return super(SummingSyncReplicasOptimizer, self).apply_gradients(
          grads_and_vars, global_step, name)
    finally:
      module.data_flow_ops = original


class _HealthKey(object):
  """What `SyncReplicasOptimizer` keys an accumulator on (its device, name
  and shape), for the health counts, which belong to no variable: no
  checkpoint holds them, and only `HealthyAverage` sees them."""

  def __init__(self, device, num_workers):
    self.device = device
    self.name = "worker_health:0"
    self._shape = tf.TensorShape([2, num_workers])

  def get_shape(self):
    return self._shape


class WorkerUnit(object):
  """Which workers a sync step leaves out, and their counters.

  The worker's half: `contribution` (what it pushes). The chief's half,
  built by `HealthyAverage` when the chief's apply is built and read by the
  decision (`guard_parts.TowerUnit`): `skip` (fewer healthy workers than
  `min_healthy`: the whole step is skipped, as non-finite), `degraded` (some
  worker left out: a loss scale halves as on a skip), `on_apply()` (counts
  the left-out workers), `variables`; and for the chief's report `step`,
  `pushed` and `healthy` (float32 [num_workers], pushes and healthy pushes
  per worker in the step).
  """

  keep_updates = None  # Statistics travel as deltas, averaged the same way.
  REJECTED = REJECTED  # Its count's key in the step's totals.

  def __init__(self, num_workers, worker_index, min_healthy_,
               variables_device):
    self.num_workers = num_workers
    self.worker_index = worker_index
    self.min_healthy = min_healthy_
    self.skip = self.degraded = self.pushed = self.healthy = None
    with tf1.device(variables_device):
      # Optional in checkpoints of runs without the option.
      self.rejected = tf1.Variable(
          tf.zeros([num_workers], tf.int64), trainable=False, name=REJECTED,
          collections=[tf1.GraphKeys.GLOBAL_VARIABLES,
                       criteria.OPTIONAL_STATE])

  @property
  def variables(self):
    return [self.rejected]

  def on_apply(self):
    """Op for the apply branch: each left-out worker's `rejected` += its
    unhealthy pushes."""
    return tf1.assign_add(self.rejected,
                          tf.cast(self.pushed - self.healthy, tf.int64))

  def contribution(self, pairs, unhealthy, global_step, extra_flags=()):
    """(the pairs this worker pushes, its bool scalar `healthy`).

    Args:
      pairs: its (gradient, variable) pairs, statistics deltas included.
      unhealthy: bool scalar, True if a gradient, delta or tower of it is
        not finite (the worker's own view computes it anyway).
      global_step: the run's; the health counts' accumulator sits with it.
      extra_flags: more (reason, bool scalar) verdicts that leave this
        worker out (e.g. a tower-agreement criterion), or-ed in.
    """
    with tf1.name_scope("worker_unit"):
      bad = [unhealthy] + [flag for _, flag in extra_flags]
      healthy = tf.logical_not(bad[0] if len(bad) == 1 else
                               tf.reduce_any(tf.stack(bad)), name="healthy")
      pushes = [(None if g is None else _select(healthy, g), v)
                for g, v in pairs]
      mine = tf.one_hot(self.worker_index, self.num_workers)
      counts = tf.stack([mine, mine * tf.cast(healthy, tf.float32)],
                        name="health_counts")
    return pushes + [(counts, _HealthKey(global_step.device,
                                         self.num_workers))], healthy

  def chief_average(self, grads_and_vars):
    """The chief's half: the summed aggregates divided by the healthy count
    (the health counts taken out); sets `skip`, `degraded` and the
    report's tensors."""
    pairs = [(g, v) for g, v in grads_and_vars
             if not isinstance(v, _HealthKey)]
    counts = [g for g, v in grads_and_vars if isinstance(v, _HealthKey)][0]
    with tf1.name_scope("worker_unit_average"):
      self.pushed, self.healthy = counts[0], counts[1]
      num_healthy = tf.reduce_sum(self.healthy)
      self.skip = tf.less(num_healthy, float(self.min_healthy),
                          name="too_few")
      self.degraded = tf.less(num_healthy, tf.reduce_sum(self.pushed),
                              name="degraded")
      # Never a division by 0 (the sums are then 0, and the step skips).
      divisor = tf.maximum(num_healthy, 1.0)
      return [(None if g is None else _divide(g, divisor), v)
              for g, v in pairs]


def _select(healthy, grad):
  """`grad` if `healthy`, else zeros: a select, so a NaN never leaks."""
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(_select(healthy, grad.values), grad.indices,
                            grad.dense_shape)
  return tf.where(healthy, grad, tf.zeros_like(grad))


def _divide(grad, divisor):
  """`grad` / `divisor` (a division, as TF's MEAN accumulators divide)."""
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(_divide(grad.values, divisor), grad.indices,
                            grad.dense_shape)
  return grad / tf.cast(divisor, grad.dtype.base_dtype)


class HealthyAverage(object):
  """The optimizer a `SummingSyncReplicasOptimizer` applies the aggregate
  with on the chief: `unit.chief_average`, then the guarded step (whose
  `tower_unit` is `unit`: its one decision reads the unit's verdicts)."""

  def __init__(self, guarded, unit):
    self._guarded = guarded
    self._unit = unit

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    return self._guarded.apply_gradients(
        self._unit.chief_average(list(grads_and_vars)),
        global_step, name)

  def __getattr__(self, name):  # compute_gradients, get_slot, ...
    return getattr(self._guarded, name)


def of_params(params, num_workers, worker_index, variables_device):
  """The run's `WorkerUnit` with --skip_unit=worker, else None."""
  if params.skip_unit != "worker":
    return None
  return WorkerUnit(num_workers, worker_index,
                    min_healthy(params.min_healthy_workers, num_workers),
                    variables_device)
