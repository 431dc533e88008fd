"""Synchronous replicas: the chief's one guarded decision on the aggregate.

Each worker pushes its gradients (and statistics deltas) into
`SyncReplicasOptimizer`'s accumulators on the ps; the chief's queue runner
averages every replica's and applies the average through `guard.guarded_apply`
(`_AggregateStep`), so a NaN in any replica's contribution skips the update
for everybody, and a loss scale given as a branch op changes once per
aggregate step, for all workers.
"""

import tensorflow as tf

from tf1_safe_train import guard

tf1 = tf.compat.v1


class _AggregateStep(tf1.train.Optimizer):
  """How `SyncReplicasOptimizer` applies the aggregate: the guarded step.

  Only an adaptor (SyncReplicasOptimizer calls an optimizer's
  `apply_gradients`): the step is `guard.guarded_apply` with the trainer's
  apply function. Nothing of a forward pass runs in it.
  """

  def __init__(self, apply_fn, branch_ops):
    super(_AggregateStep, self).__init__(use_locking=False,
                                         name="aggregate_guard")
    self._apply_fn = apply_fn
    self._branch_ops = list(branch_ops)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del name  # The guard names its ops.
    return guard.guarded_apply(
        grads_and_vars, self._apply_fn, global_step=global_step,
        increment_global_step_on_skip=True, update_ops=[],
        branch_ops=self._branch_ops, name="guarded_step").train_op


def _ordered_after(grads_and_vars, op):
  """The gradients, made to wait for `op` (a read that must come first)."""
  ordered = []
  with tf1.control_dependencies([op]):
    for g, v in grads_and_vars:
      if isinstance(g, tf.IndexedSlices):
        g = tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape)
      elif g is not None:
        g = tf.identity(g)
      ordered.append((g, v))
  return ordered


def sync_step(pairs, apply_fn, num_workers, global_step, step_index,
              extra_nonfinite=(), branch_ops=()):
  """This worker's side of a synchronous step.

  The worker only pushes its gradients and waits for the sync token, which
  comes after the chief's decision, applied or skipped: nobody waits for
  ever because of a skip.

  Args:
    pairs: this worker's (gradient, variable) pairs, statistics deltas
      included.
    apply_fn: the update, run by the chief inside the apply branch.
    num_workers: replicas aggregated per step (every worker).
    global_step: the global step variable.
    step_index: this step's read of it, which the push must follow.
    extra_nonfinite: this worker's per-tower flags (for its own view).
    branch_ops: e.g. the loss scale, updated by the chief's decision.

  Returns:
    (the `SyncReplicasOptimizer`, a `guard.GuardResult` of this replica's
    view: `applied` is True if its own gradients were all finite; the
    reports never fetch the chief's decision, which would run the aggregate's
    apply again; `counters` is None).
  """
  sync_optimizer = tf1.train.SyncReplicasOptimizer(
      _AggregateStep(apply_fn, branch_ops),
      replicas_to_aggregate=num_workers, total_num_replicas=num_workers)
  flags = guard.nonfinite_flags([g for g, _ in pairs if g is not None])
  step_op = sync_optimizer.apply_gradients(
      _ordered_after(pairs, step_index), global_step=global_step)
  # SyncReplicasHook runs it (a graph only inspected does not).
  sync_optimizer.ready_for_local_init_op.mark_used()
  nonfinite = tf.reduce_any(flags)
  for extra in extra_nonfinite:
    nonfinite = tf.logical_or(nonfinite, extra)
  applied = tf.logical_not(nonfinite, name="replica_finite")
  return sync_optimizer, guard.GuardResult(
      train_op=step_op, applied=applied, nonfinite_flags=flags,
      variable_names=[v.op.name for g, v in pairs if g is not None],
      counters=None, update_flags=tf.zeros([0], tf.bool),
      update_variable_names=[])


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
