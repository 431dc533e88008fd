"""Synchronous replicas: the chief's one guarded decision on the aggregate.

Each worker pushes its gradients (and statistics deltas) into
`SyncReplicasOptimizer`'s accumulators on the ps; the chief's queue runner
averages every replica's and applies the average through the guarded step
(the step's `SkipNonFiniteOptimizer`), so a NaN in any replica's contribution
skips the update for everybody, and the loss scale changes once per
aggregate step, for all workers.
"""

from absl import logging
import tensorflow as tf

from tf1_safe_train.cluster import sync_rollback
from tf1_safe_train.cluster import worker_unit
from tf1_safe_train.core import guard
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import shadows
from tf1_safe_train.core import skip_log
from tf1_safe_train.core import skip_report

tf1 = tf.compat.v1


def sync_optimizer(guarded, num_workers, unit=None):
  """`SyncReplicasOptimizer` over the step's `SkipNonFiniteOptimizer`.

  Each worker's `apply_gradients` only pushes its gradients and waits for the
  sync token, which comes after the chief's decision, applied or skipped:
  nobody waits for ever because of a skip. With a `worker_unit.WorkerUnit`,
  the project's summing variant, over the healthy workers' average.
  """
  if unit is not None:
    return worker_unit.SummingSyncReplicasOptimizer(
        worker_unit.HealthyAverage(guarded, unit),
        replicas_to_aggregate=num_workers, total_num_replicas=num_workers)
  optimizer = tf1.train.SyncReplicasOptimizer(
      guarded, replicas_to_aggregate=num_workers,
      total_num_replicas=num_workers)
  return optimizer


def own_fault(pairs, tower_nonfinite):
  """bool scalar: True if a gradient (or statistics delta) of `pairs` or a
  tower flag of this worker is not finite (one fused check)."""
  with tf1.name_scope("replica_view"):
    return _or_towers(nonfinite.any_nonfinite(
        [g for g, _ in pairs if g is not None]), tower_nonfinite)


def replica_view(optimizer, pairs, tower_nonfinite, fault=None):
  """This worker's `guard.GuardResult`-like view of a synchronous step.

  `applied` is True if this worker's own gradients (and statistics deltas)
  were all finite: the reports never fetch the chief's decision, which
  would run the aggregate's apply again. `counters` is None.

  The reports fetch the view every step, so a good step pays for one fused
  check of the gradients (`nonfinite.any_nonfinite`) only; the per-variable
  flags, which name the variables of a skip, are checked when that says a
  gradient is not finite (see `_flags_on_fault`).

  Args:
    optimizer: the `SyncReplicasOptimizer`, after `apply_gradients`.
    pairs: this worker's (gradient, variable) pairs; None gradients are
      left out of the flags and `variable_names`, `IndexedSlices` are
      checked through their values.
    tower_nonfinite: bool vector, one flag per tower of this worker (a
      constant False for one tower, whose gradients are `pairs`).
    fault: `own_fault(pairs, tower_nonfinite)` if built already.
  """
  # SyncReplicasHook runs it (a graph only inspected does not).
  optimizer.ready_for_local_init_op.mark_used()
  checked = [(g, v) for g, v in pairs if g is not None]
  grads = [g for g, _ in checked]
  if fault is None:
    fault = own_fault(pairs, tower_nonfinite)
  with tf1.name_scope("replica_view"):
    applied = tf.logical_not(fault, name="replica_finite")
    flags = _flags_on_fault(fault, grads)
  return guard.GuardResult(
      train_op=None, applied=applied, nonfinite_flags=flags,
      variable_names=[v.op.name for _, v in checked],
      counters=None, update_flags=tf.zeros([0], tf.bool),
      update_variable_names=[])


def _or_towers(any_bad, tower_nonfinite):
  """`any_bad` or any tower flag; `any_bad` alone if the flags are a
  constant False (a one-tower worker's: `train_step` checks no tower of
  its own).

  Never `or(False, any_bad)`: Grappler (TF 2.21; its constant folding,
  which turns that `or` into an Identity, and its arithmetic optimizer,
  which removes `not(not(x))` pairs) compiled `not(or(False, not(all)))`
  into `all` for the cond on `applied` (the batch store's) but into
  `not(all)` for the fetched `applied`: the reports saw every good step
  as a skip and a NaN step as applied (tests/cluster/sync_replicas_view_test.py
  OneTowerWorkerTest).
  """
  flags = tf.get_static_value(tower_nonfinite)
  if flags is not None and not flags.any():
    return any_bad
  return tf.logical_or(tf.reduce_any(tower_nonfinite), any_bad)


def _flags_on_fault(any_bad, grads):
  """`nonfinite.nonfinite_flags(grads)`, checked only if `any_bad`.

  Otherwise all False, which the fused check proved. As the guard's skip
  branch, but here no other branch captures the gradients, so the cond's
  lowering adds a `Switch` per gradient to every step: one node that
  forwards its input (no kernel on a GPU) instead of a check chain of three
  kernels (`IsFinite`, `All`, `LogicalNot`) each. An `If` left unlowered
  would run no `Switch`, but would copy to its own device, every step, each
  gradient held on another.
  """
  if not grads:
    return tf.zeros([0], tf.bool)
  return tf.cond(any_bad, lambda: nonfinite.nonfinite_flags(grads),
                 lambda: tf.zeros([len(grads)], tf.bool),
                 name="nonfinite_flags")


class ChiefDecisions(object):
  """What the chief tells of each aggregate's decision, where it is made.

  The decision runs in the chief's queue runner, whose run fetches
  `fetches` with the token enqueue (the same run: decided once); `tell`
  logs and records from those values: a skip for a criterion other than
  non-finite (a spike of the aggregate: no worker saw it) gets its line and
  its `skips.jsonl` record (the chief's, worker 0's file); with the worker
  unit, a step that left workers out says `applied k of N workers`, one
  with too few healthy workers that it was skipped whole. A non-finite
  skip is told by the worker whose gradients were not finite.
  """

  def __init__(self, params, result, global_step, unit):
    self._params = params
    self._reasons = result.reasons
    with tf1.name_scope("chief_decision"):
      with tf1.control_dependencies([result.train_op]):
        # Only the chief's decision advances global_step in sync mode.
        step = tf.raw_ops.Snapshot(
            input=shadows.read_written(global_step)) - 1
    self.fetches = {"step": step, "applied": result.applied,
                    "criteria": result.reasons.fetches}
    self._unit = unit
    if unit is not None:
      self.fetches.update(pushed=unit.pushed, healthy=unit.healthy,
                          too_few=unit.skip)

  def tell(self, values):
    """Logs (and records) one decision from its fetched `values`."""
    step = int(values["step"])
    if "pushed" in values:
      line = skip_report.workers_line(step, values["pushed"],
                                      values["healthy"], values["too_few"],
                                      self._unit.min_healthy)
      if line:
        logging.warning("%s", line)
    if values["applied"]:
      return
    reason = self._reasons.label(values["criteria"])
    if reason == skip_report.NONFINITE:
      return
    logging.warning("%s", skip_report.line(step, reason, self._reasons,
                                           values["criteria"]))
    skip_log.append(skip_log.path(self._params.train_dir, 0),
                    skip_report.record(step, 0, reason, self._reasons,
                                       values["criteria"], towers=[],
                                       decided_on="aggregate"))


class _TellingQueueRunner(tf1.train.QueueRunner):
  """The chief's queue runner, which also fetches each decision's values
  and hands them to `tell` (TF's `_run`, with the fetch)."""

  def __init__(self, queue, enqueue_op, decisions):
    super(_TellingQueueRunner, self).__init__(
        queue, [enqueue_op],
        queue_closed_exception_types=(tf.errors.OutOfRangeError,
                                      tf.errors.CancelledError))
    self._decisions = decisions

  def _run(self, sess, enqueue_op, coord=None):
    try:
      run = sess.make_callable([enqueue_op, self._decisions.fetches])
      while not (coord and coord.should_stop()):
        try:
          _, values = run()
        except self._queue_closed_exception_types:  # pylint: disable=catching-non-exception
          # As TF's: close the token queue, so no worker waits on a token.
          try:
            sess.run(self._close_op)
          except Exception:  # pylint: disable=broad-except
            pass
          return
        self._decisions.tell(values)
    except Exception as e:  # pylint: disable=broad-except
      if coord is None:
        raise
      coord.request_stop(e)
    finally:
      with self._lock:
        self._runs_per_session[sess] -= 1


class SyncReplicasHook(tf1.train.SessionRunHook):
  """`SyncReplicasOptimizer.make_session_run_hook`, with a quiet ending.

  Runs the optimizer's initialisation ops and, on the chief, the queue
  runner that applies the aggregates. At the end that thread may still wait
  in the gradient accumulators for replicas that have stopped; closing the
  session cancels it, which TF's own queue runner reports as a crash
  (a traceback after every clean run). Here a cancelled run ends the thread
  like a closed queue does.
  """

  def __init__(self, sync_optimizer, is_chief, decisions=None, point=None):
    """Args:
      sync_optimizer: the `SyncReplicasOptimizer`.
      is_chief: whether this task runs the aggregates.
      decisions: the chief's `ChiefDecisions` to fetch and tell, or None.
      point: function(session) the chief runs after each update, before
        its tokens (a rollback's: `sync_rollback.PointQueueRunner`), or
        None.
    """
    self._optimizer = sync_optimizer
    self._is_chief = is_chief
    self._decisions = decisions
    self._point = point
    self._init_ops = []
    self._queue_runner = None

  def begin(self):
    optimizer = self._optimizer
    if not self._is_chief:
      self._init_ops = [optimizer.local_step_init_op]
      return
    self._init_ops = [optimizer.chief_init_op, optimizer.get_init_tokens_op()]
    runner = optimizer.get_chief_queue_runner()
    closed = (tf.errors.OutOfRangeError, tf.errors.CancelledError)
    if self._point is not None:
      self._queue_runner = sync_rollback.PointQueueRunner(
          runner, self._point, closed, self._decisions)
      return
    if self._decisions is not None:
      [enqueue] = runner.enqueue_ops
      self._queue_runner = _TellingQueueRunner(runner.queue, enqueue,
                                               self._decisions)
      return
    self._queue_runner = tf1.train.QueueRunner(
        runner.queue, runner.enqueue_ops, queue_closed_exception_types=closed)

  def after_create_session(self, session, coord):
    # As TF's hook: the session creator has already waited for this.
    not_ready = session.run(self._optimizer.ready_for_local_init_op)
    if not_ready.size:
      raise RuntimeError("variables not initialised for the sync replicas: "
                         "%s" % ", ".join(v.decode() for v in not_ready))
    for op in self._init_ops:
      session.run(op)
    if self._queue_runner is not None:
      self._queue_runner.create_threads(session, coord=coord, daemon=True,
                                        start=True)
