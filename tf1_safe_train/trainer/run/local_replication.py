"""The replication interface the runner uses, and its one-process strategy.

A strategy says where a run's towers and state live and who decides on the
step; `train_lib` and `train_step` use it without asking which mode runs.
`Local` (one process: state on its CPU, the step decides) is the trainer's
own; a between-graph cluster's strategies (`tf1_safe_train.cluster.
replication`) are built on it, and a binary's main module passes one to
`train_lib.train`: the trainer never imports the cluster.

The interface, in the order the runner uses it:
  `tower_config`, `is_chief`, `worker_index`, `num_workers`, `liveness`,
  `stop_grace_secs`         (attributes)
  `start()`                 before the graph (a cluster's server)
  `device()`                context the step is built in
  `tower_devices()`         the towers' full device strings, for reports
  `statistics(update_ops)`  (statistics deltas decided with the gradients,
                            update ops the decision rolls back)
  `decision_unit()`         a unit of the decision beyond the towers (a
                            sync cluster's `--skip_unit=worker`), or None
  `decide(guarded, pairs, global_step, tower_nonfinite, **kwargs)`
                            applies the gradients through the step's
                            `SkipNonFiniteOptimizer` (or what calls it);
                            returns a `Decided`: the step's op, the
                            `guard.GuardResult` the reports show, the
                            decision's `reasons.Report` (its counters)
  `after_build(step)`       ops the end of the run needs
  `step_hooks(rollback)`    hooks that run the step's own machinery
                            (`rollback`: the run's `RollbackHook` or None;
                            a sync cluster rolls back where its chief's
                            machinery says)
  `session(scaffold, hooks, stopped_by_signal, first_hooks=())`  the
                            MonitoredSession
  `finish()`, `summary_fields()`  after the session closed

The hooks of a run, in order: a cluster worker's `EndOfRunHook` first (so
its `end` precedes the final checkpoint), the runner's `first_hooks` (a
skip's line, then what must be written before a checkpoint covers the
step: its record), the chief's summary and checkpoint savers, then the
runner's other hooks
(`train_lib`), with `step_hooks()` after its reporting hooks.
"""

import collections
import contextlib

import tensorflow as tf

from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1

Decided = collections.namedtuple("Decided", ["step_op", "result", "reasons"])
Decided.__doc__ = """A strategy's decision on the step (`decide`).

Attributes:
  step_op: applies (or skips) the step.
  result: the `guard.GuardResult` the reports show (a sync worker's own
    view: `cluster.sync_replicas.replica_view`).
  reasons: the decision's `reasons.Report`, whose counters the run reads
    (a sync worker: the chief's decision's, the counts being shared).
"""


class Local(object):
  """One process: towers on its devices, state on its CPU."""

  in_cluster = False
  num_workers = 1
  liveness = None
  stop_grace_secs = None
  skip_relay = None  # One process's records are all in its train_dir.

  def __init__(self, params, tower_config=None, master="", is_chief=True,
               worker_index=0):
    self.params = params
    self.tower_config = tower_config or towers.TowerConfig(
        params.num_towers, params.device)
    self.master = master
    self.is_chief = is_chief
    self.worker_index = worker_index

  def start(self):
    pass

  def device(self):
    return contextlib.nullcontext()

  def tower_devices(self):
    config = self.tower_config
    return [config.tower_device(i) for i in range(config.num_towers)]

  def statistics(self, update_ops):
    """In one process the decision rolls the update ops back itself."""
    return [], update_ops

  def decision_unit(self):
    """None: one process has no worker to leave out."""
    return None

  def decide(self, guarded, pairs, global_step, tower_nonfinite, **kwargs):
    """Applies `pairs` through the guarded wrapper: its result, returned."""
    del tower_nonfinite  # The decision checked every tower's.
    result = guarded.apply_gradients_with_result(
        pairs, global_step=global_step, **kwargs)
    return Decided(result.train_op, result, result.reasons)

  def after_build(self, step):
    del step  # Nothing outlives a local run.

  def worker_quarantine(self, clear):
    """None: one process has no worker to quarantine."""
    del clear
    return None

  def run_step(self, session, train_op):
    """Runs one step (a quarantined cluster worker pushes idle instead)."""
    session.run(train_op)

  def step_hooks(self, rollback=None):
    del rollback  # Its own `after_run` rolls back on one machine.
    return []

  def session(self, scaffold, hooks, stopped_by_signal, first_hooks=()):
    """MonitoredTrainingSession: on the chief, its summary and checkpoint
    savers run before `hooks` (TF's order, as in a cluster's `session`),
    after `first_hooks` (e.g. what must be written before a checkpoint)."""
    del stopped_by_signal  # Nobody else waits for this process.
    params = self.params
    first_hooks = list(first_hooks)
    return tf1.train.MonitoredTrainingSession(
        master=self.master, is_chief=self.is_chief,
        checkpoint_dir=params.train_dir, scaffold=scaffold,
        # TF runs chief-only hooks before its savers (not chief: no savers).
        chief_only_hooks=first_hooks if self.is_chief else None,
        hooks=list(hooks) if self.is_chief else first_hooks + list(hooks),
        save_checkpoint_steps=params.save_checkpoints_steps,
        save_summaries_steps=params.save_summaries_steps,
        log_step_count_steps=None,
        config=towers.session_config(self.tower_config))

  def finish(self):
    pass

  def summary_fields(self):
    """(final reads for the run summary or None, extra summary fields)."""
    return None, {}
