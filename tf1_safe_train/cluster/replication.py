"""A cluster's replication strategies, built on the trainer's `Local`.

One class per mode behind the interface of `trainer.local_replication`, so
the runner (`train_lib`) and the step (`train_step`) never ask which mode
they are in:

  `Local`          (the trainer's) one process; state on its CPU, the step
                   decides.
  `AsyncReplicas`  one worker of a between-graph cluster (`replicas`): state
                   on the parameter servers, each worker decides on its own
                   gradients.
  `SyncReplicas`   the same, but the chief decides on the aggregate of
                   every worker's gradients (`sync_replicas`).

`make` chooses one for a run; //:train's main module passes it to
`train_lib.train` (the trainer never imports this package).
"""

from absl import logging
import tensorflow as tf

from tf1_safe_train.cluster import ps_watch
from tf1_safe_train.cluster import replicas
from tf1_safe_train.cluster import skip_relay
from tf1_safe_train.cluster import spec as cluster_lib
from tf1_safe_train.cluster import sync_replicas
from tf1_safe_train.cluster import worker_quarantine
from tf1_safe_train.cluster import worker_unit
from tf1_safe_train.core import rollback
from tf1_safe_train.trainer.run import local_replication

tf1 = tf.compat.v1


class AsyncReplicas(local_replication.Local):
  """A worker of a cluster; each worker's step decides alone."""

  in_cluster = True
  sync = False

  def __init__(self, params, cluster):
    if cluster.job_name != cluster_lib.WORKER:
      raise ValueError("train() runs a worker; %s runs "
                       "serve_parameter_server" % cluster.task_name)
    super(AsyncReplicas, self).__init__(
        params, replicas.cluster_tower_config(params, cluster),
        is_chief=cluster.is_chief, worker_index=cluster.task_index)
    self.cluster = cluster
    self.num_workers = cluster.num_workers
    self.stop_grace_secs = replicas.SIGNAL_GRACE_SECS
    self._server = None
    self._end_ops = None
    self._end_hook = None
    self._session_config = replicas.cluster_session_config(
        self.tower_config, cluster)

  @property
  def liveness(self):
    return ps_watch.ParameterServerWatch(self.cluster,
                                         self.params.startup_timeout_secs)

  def start(self):
    cluster = self.cluster
    cluster_lib.wait_for_ps(cluster, self.params.startup_timeout_secs)
    self._server = replicas.start_server(cluster, self.params)
    self.master = self._server.target
    logging.info("%s of %s at %s (%s)", cluster.task_name, cluster.cluster,
                 cluster.address, "synchronous replicas" if self.sync
                 else "asynchronous replicas")

  def device(self):
    return tf1.device(replicas.worker_device(self.cluster))

  def tower_devices(self):
    prefix = replicas.worker_device(self.cluster)
    return [prefix + d for d in super(AsyncReplicas, self).tower_devices()]

  def statistics(self, update_ops):
    """Deltas applied with the decision (see `rollback.statistics_deltas`).

    The ps hold the statistics every worker writes: each worker's own
    writes would race the others' rollbacks.
    """
    with tf1.device(self.tower_config.variables_device()):
      return rollback.statistics_deltas(update_ops), []

  def _close_tokens(self):
    return None

  def after_build(self, step):
    self._end_ops = replicas.end_of_run_ops(self.cluster, step.variables,
                                            self._close_tokens())
    self.skip_relay = skip_relay.SkipRelay(self.num_workers)

  def step_hooks(self, rollback=None):
    """The chief drains the workers' skip records into its train_dir."""
    del rollback  # Refused without --sync_replicas.
    return [skip_relay.DrainHook(self.skip_relay, self.params.train_dir)
            ] if self.is_chief else []

  def session(self, scaffold, hooks, stopped_by_signal, first_hooks=()):
    """The worker's session. Hook order (explicit):

    1. `EndOfRunHook`: its `end` runs first, so the chief's final checkpoint
       (3.) comes after every worker's last step;
    2. `first_hooks` (what must be written before a checkpoint);
    3. on the chief, `CheckpointSaverHook` and `SummarySaverHook`;
    4. `hooks`, as the runner ordered them.
    """
    self._end_hook = replicas.EndOfRunHook(
        self.cluster, self._end_ops, stopped_by_signal, replicas.END_WAIT_SECS)
    savers = _chief_savers(self.params, scaffold) if self.is_chief \
        else []
    return replicas.cluster_session(
        self.params, self.cluster, self.master, self._session_config,
        scaffold,
        [self._end_hook] + list(first_hooks) + savers + list(hooks))

  def finish(self):
    replicas.report_done(self._server, self._end_ops, self._session_config,
                         self.params.startup_timeout_secs)

  def summary_fields(self):
    cluster = self.cluster
    return self._end_hook.final if self._end_hook else None, {"cluster": {
        "num_ps": cluster.num_ps, "num_workers": cluster.num_workers,
        "task": cluster.task_name, "sync_replicas": self.sync}}


def _chief_savers(params, scaffold):
  """The chief's checkpoint and summary savers (MonitoredTrainingSession's)."""
  return [
      tf1.train.CheckpointSaverHook(
          params.train_dir, save_steps=params.save_checkpoints_steps,
          scaffold=scaffold),
      tf1.train.SummarySaverHook(
          save_steps=params.save_summaries_steps,
          output_dir=params.train_dir, scaffold=scaffold),
  ]


class SyncReplicas(AsyncReplicas):
  """A worker of a cluster whose chief decides on the aggregate.

  This worker only pushes its gradients (and statistics deltas) and waits
  for the sync token; the chief's queue runner averages every replica's and
  takes the one guarded decision, the loss scale's update included, so all
  workers train with one scale.
  """

  sync = True

  def __init__(self, params, cluster):
    super(SyncReplicas, self).__init__(params, cluster)
    self.sync_optimizer = None
    self.unit = None
    self._decision = None
    self._quarantine = self._idle = None

  def decision_unit(self):
    """With --skip_unit=worker, the run's `worker_unit.WorkerUnit` (made
    once: the step's guarded wrapper and `decide` share it), else None."""
    if self.unit is None:
      self.unit = worker_unit.of_params(
          self.params, self.num_workers, self.worker_index,
          self.tower_config.variables_device())
    return self.unit

  def decide(self, guarded, pairs, global_step, tower_nonfinite, **kwargs):
    """Pushes `pairs` (with the worker unit: selected by this worker's
    health, with its count); the chief's `SyncReplicasOptimizer` decides
    (through `guarded`, whose result its API does not return: the wrapper
    keeps it). The reports show this worker's own view; the chief's
    decision is told by the chief's runner (`sync_replicas.ChiefDecisions`)."""
    unit = self.decision_unit()
    fault = sync_replicas.own_fault(pairs, tower_nonfinite)
    pushes = pairs
    if unit is not None:
      pushes, _ = unit.contribution(pairs, fault, global_step)
    self.sync_optimizer = sync_replicas.sync_optimizer(
        guarded, self.num_workers, unit)
    step_op = self.sync_optimizer.apply_gradients(
        pushes, global_step=global_step, **kwargs)
    result = guarded.guard_result()  # The chief's decision, built here.
    self._decision = sync_replicas.ChiefDecisions(
        self.params, result, global_step, unit)
    if self._quarantine is not None:
      self._idle = worker_quarantine.IdlePush(self.sync_optimizer)
    return local_replication.Decided(
        step_op, sync_replicas.replica_view(self.sync_optimizer, pairs,
                                            tower_nonfinite, fault),
        result.reasons)

  def worker_quarantine(self, clear):
    """With --skip_unit=worker and --quarantine_after, this segment's
    `worker_quarantine.WorkerQuarantine` (built before the step), else
    None."""
    params = self.params
    self._quarantine = self._idle = None
    if params.skip_unit == "worker" and params.quarantine_after:
      self._quarantine = worker_quarantine.WorkerQuarantine(
          params, self.num_workers, self.worker_index,
          worker_unit.min_healthy(params.min_healthy_workers,
                                  self.num_workers), clear)
    return self._quarantine

  def run_step(self, session, train_op):
    """One step; a quarantined worker pushes idle (computes nothing)."""
    if self._quarantine is not None and self._quarantine.quarantined:
      self._idle.run(session, self.params.max_steps)
    else:
      session.run(train_op)

  def _close_tokens(self):
    return self.sync_optimizer.get_chief_queue_runner().queue.close(
        cancel_pending_enqueues=False)

  def step_hooks(self, rollback=None):
    """The sync machinery; with `rollback` (a `RollbackHook`), its chief
    rolls back between an update and its tokens (`sync_rollback`)."""
    return [sync_replicas.SyncReplicasHook(
        self.sync_optimizer, self.is_chief, self._decision,
        point=rollback.sync_point() if rollback is not None else None)
            ] + super(SyncReplicas, self).step_hooks()


def make(params, cluster=None):
  """The strategy of a run: `Local`, or this cluster worker's."""
  if cluster is None:
    return local_replication.Local(params)
  if params.sync_replicas:
    return SyncReplicas(params, cluster)
  return AsyncReplicas(params, cluster)
