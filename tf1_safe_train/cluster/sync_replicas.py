"""Synchronous replicas: the chief's one guarded decision on the aggregate.

Each worker pushes its gradients (and statistics deltas) into
`SyncReplicasOptimizer`'s accumulators on the ps; the chief's queue runner
averages every replica's and applies the average through the guarded step
(the step's `SkipNonFiniteOptimizer`), so a NaN in any replica's contribution
skips the update for everybody, and the loss scale changes once per
aggregate step, for all workers.
"""

import tensorflow as tf

from tf1_safe_train.core import guard
from tf1_safe_train.core import nonfinite

tf1 = tf.compat.v1


def sync_optimizer(guarded, num_workers):
  """`SyncReplicasOptimizer` over the step's `SkipNonFiniteOptimizer`.

  Each worker's `apply_gradients` only pushes its gradients and waits for the
  sync token, which comes after the chief's decision, applied or skipped:
  nobody waits for ever because of a skip.
  """
  optimizer = tf1.train.SyncReplicasOptimizer(
      guarded, replicas_to_aggregate=num_workers,
      total_num_replicas=num_workers)
  return optimizer


def replica_view(optimizer, pairs, tower_nonfinite):
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
  """
  # SyncReplicasHook runs it (a graph only inspected does not).
  optimizer.ready_for_local_init_op.mark_used()
  checked = [(g, v) for g, v in pairs if g is not None]
  grads = [g for g, _ in checked]
  with tf1.name_scope("replica_view"):
    any_bad = nonfinite.any_nonfinite(grads)
    applied = tf.logical_not(_or_towers(any_bad, tower_nonfinite),
                             name="replica_finite")
    flags = _flags_on_fault(any_bad, grads)
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


class SyncReplicasHook(tf1.train.SessionRunHook):
  """`SyncReplicasOptimizer.make_session_run_hook`, with a quiet ending.

  Runs the optimizer's initialisation ops and, on the chief, the queue
  runner that applies the aggregates. At the end that thread may still wait
  in the gradient accumulators for replicas that have stopped; closing the
  session cancels it, which TF's own queue runner reports as a crash
  (a traceback after every clean run). Here a cancelled run ends the thread
  like a closed queue does.
  """

  def __init__(self, sync_optimizer, is_chief):
    self._optimizer = sync_optimizer
    self._is_chief = is_chief
    self._init_ops = []
    self._queue_runner = None

  def begin(self):
    optimizer = self._optimizer
    if not self._is_chief:
      self._init_ops = [optimizer.local_step_init_op]
      return
    self._init_ops = [optimizer.chief_init_op, optimizer.get_init_tokens_op()]
    runner = optimizer.get_chief_queue_runner()
    self._queue_runner = tf1.train.QueueRunner(
        runner.queue, runner.enqueue_ops,
        queue_closed_exception_types=(tf.errors.OutOfRangeError,
                                      tf.errors.CancelledError))

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
