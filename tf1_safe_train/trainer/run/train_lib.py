"""The trainer's runner: the session, its hooks, the run summary.

`train(params)` builds the step (`train_step.build_step`) as the run's
replication strategy places and decides it (`local_replication.Local`, or a
binary's: a worker of a between-graph cluster, asynchronous or synchronous,
`tf1_safe_train.cluster.replication`), runs it under a MonitoredSession to
the run's end and writes `<train_dir>/run_summary.json` (`run_story`: what
the log says first and last).
"""

import contextlib
import time

import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train.trainer.checkpoint import checkpoint_fit
from tf1_safe_train.trainer.recovery import checkpoint_rollback
from tf1_safe_train.trainer.recovery import checkpoint_rollback_target
from tf1_safe_train.trainer.checkpoint import checkpoints
from tf1_safe_train.trainer.checkpoint import finite_state
from tf1_safe_train.trainer.explain import forensics
from tf1_safe_train.trainer.run import hooks as hooks_lib
from tf1_safe_train.trainer.checkpoint import last_good
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.tower import quarantine as quarantine_lib
from tf1_safe_train.trainer.run import run_story
from tf1_safe_train.trainer.run import run_summary
from tf1_safe_train.trainer.run import segments as segments_lib
from tf1_safe_train.trainer.step import step_summaries
from tf1_safe_train.trainer.tower import tower_report
from tf1_safe_train.trainer.tower import tower_unit
from tf1_safe_train.trainer.run import train_dir as train_dir_lib
from tf1_safe_train.trainer.step import train_step
from tf1_safe_train.trainer.explain import verdict_counts

tf1 = tf.compat.v1

TrainDirError = train_dir_lib.TrainDirError  # Its old home; train.py's.


def train(params, extra_hooks=(), dataset_fn=None, strategy=None,
          criteria=()):
  """Trains as `params` says and returns the run summary (a dict).

  Args:
    params: validated `params.TrainParams`.
    extra_hooks: more `SessionRunHook`s, run after the trainer's.
    dataset_fn: optional input pipeline in place of `params.dataset`'s (see
      `train_step.build_step`).
    strategy: the run's replication strategy (default:
      `local_replication.Local(params)`), e.g. a `Local` with other towers
      or another session target, or a cluster worker's
      (`tf1_safe_train.cluster.replication.make`; its `start` starts this
      process's gRPC server).
    criteria: more skip criteria (`criteria.Criterion` objects) for the
      step (`train_step.build_step`); reported and counted by reason.

  Returns:
    The dict also written to `run_summary.json` (by the chief).

  Raises:
    cluster.ClusterError: (a cluster worker's strategy) if this task's
      server cannot start, or (`ClusterUnreachableError`) a ps does not
      answer within `params.startup_timeout_secs`.
  """
  params.validate()
  if strategy is not None and strategy.in_cluster:
    refusal = (checkpoint_rollback.refusal_in_cluster(params) or
               tower_unit.refusal_in_cluster(params))
    if refusal:
      raise params_lib.ParamsError(refusal)
  elif params.skip_unit == "worker":
    raise params_lib.ParamsError(
        "--skip_unit=worker runs in a cluster only (with --sync_replicas); "
        "on one machine use --skip_unit=tower")
  chief = strategy is None or strategy.is_chief
  if chief:
    train_dir_lib.check(params.train_dir)
  # Held from before anything reads the train_dir or builds a graph (a
  # second trainer is refused at once) to the end of the last segment.
  with (train_dir_lib.lock(params.train_dir) if chief
        else contextlib.nullcontext()):
    strategy = strategy or local_replication.Local(params)
    # A tower quarantined ends a segment: the step is rebuilt without it
    # (`segments`: what goes on across the rebuild).
    segments = segments_lib.Segments(params, strategy, dataset_fn)
    clear = params.clear_quarantine
    try:
      while True:
        summary, restart = _train(params, extra_hooks, dataset_fn, strategy,
                                  criteria, clear, segments)
        if not restart:
          run_story.log_end(summary, params.train_dir if chief else None)
          return summary
        clear = False
    finally:
      segments.uninstall_signals()


def _train(params, extra_hooks, dataset_fn, strategy, criteria, clear,
           segments):
  """`train`'s one segment: (run summary, whether the step is rebuilt: a
  tower quarantined, no signal)."""
  strategy.start()
  start = time.time()
  quarantine = (quarantine_lib.Quarantine(
      params, strategy.tower_devices(), max(2, tower_unit.min_healthy(
          params.min_healthy_towers, params.num_towers)), clear)
                if params.quarantine_after and params.skip_unit == "tower"
                else None)
  workers = strategy.worker_quarantine(clear)  # --skip_unit=worker's.
  with tf.Graph().as_default():
    tf1.set_random_seed(params.seed)
    with strategy.device():
      step = train_step.build_step(
          params, strategy, dataset_fn=dataset_fn,
          exclude_ids=segments.exclude_ids, criteria=criteria,
          skip_batches=segments.batches_read,
          quarantined=quarantine.quarantined if quarantine else ())
      strategy.after_build(step)
      for each in (quarantine, workers):
        if each:
          each.build(strategy.tower_config.variables_device())
    run = segments.run = _RunHooks(
        params, step, strategy, start, segments,
        describe_id=lambda i: data.describe_id(
            params.dataset if dataset_fn is None else "dataset_fn", i),
        quarantine=quarantine, workers=workers)
    run_hooks = run.in_order(extra_hooks)
    resume = None
    if strategy.is_chief:
      resume = checkpoints.prepare_resume(params.train_dir,
                                          tf1.global_variables(), params)
    run_story.log_start(params, step, strategy, resume, quarantine)
    saver = _saver(params, step, run.state_check, run.state_hook, resume,
                   run.give_up.lock if isinstance(
                       run.give_up, checkpoint_rollback.RollbackHook) else None)
    if isinstance(run.give_up, checkpoint_rollback.RollbackHook):
      run.give_up.attach(resume)
    rebuild = _run_steps(step, strategy, tf1.train.Scaffold(saver=saver),
                         run, run_hooks, segments, quarantine)
    summary = run.summary()
    if strategy.is_chief:  # Under the lock, as every write of the run.
      run_summary.write(params.train_dir, summary)
  return summary, rebuild


class _RunHooks(object):
  """The runner's hooks of one run, and the run summary they make.

  Built after the step, before the saver: a hook's graph ops and state
  variables must exist when the saver lists the variables.
  """

  def __init__(self, params, step, strategy, start, segments, describe_id,
               quarantine, workers=None):
    self._params, self._step, self._strategy = params, step, strategy
    self.quarantine, self.workers = quarantine, workers
    self._start, self._excluded = start, segments.excluded
    self.first_step_time = None
    is_chief = strategy.is_chief
    self.explain = forensics.ForensicsHook(
        step, params, strategy.worker_index, params.max_explained_skips,
        summary_dir=params.train_dir if is_chief else None,
        describe_id=describe_id,
        # On one machine only: in a cluster one worker's stop would leave
        # the others waiting; its streak ends the run there. (`give_up` is
        # made below, before the session runs.)
        on_model=None if strategy.in_cluster else (
            lambda context, at: checkpoint_rollback.act_on_model_fault(
                self.give_up, context, at)),
        quarantine=quarantine or workers,  # A tower's or this worker's.
        # A cluster's: the chief's records carry every worker's.
        relay=None if is_chief else strategy.skip_relay)
    self.examples_per_step = (params.batch_size *
                              strategy.tower_config.num_towers)
    self.stats = hooks_lib.RunStatsHook(dict(
        step.totals, loss=step.loss,
        **({"loss_scale": step.loss_scale.scale} if step.loss_scale else {})))
    # With a loss scale, skips that halve it are expected overflows; only
    # skips at the floor scale are faults that count toward giving up.
    # (Or rolls back instead: `checkpoint_rollback`.)
    self.give_up = checkpoint_rollback.give_up_hook(
        params, step.loss_scale.floor_skips if step.loss_scale
        else step.counters.consecutive_skips, step)
    # A skip's line, then (`explain`) its explanation.
    self.skip_line = hooks_lib.SkipReportHook.of_step(step)
    self.on_signal = segments.on_signal  # The process's (`segments`).
    self.state_check = finite_state.FiniteStateCheck()
    self.state_hook = finite_state.NonFiniteStateHook(
        self.state_check, step.step_index, step.applied,
        finite_state.likely_cause(params))

  def in_order(self, extra_hooks):
    """The hooks in the order they run (the strategy puts its own around
    them; `skip_line`, then `explain`, run first: `first_hooks`)."""
    params, step = self._params, self._step
    return [
        hooks_lib.StopAtStepHook(params.max_steps),
        hooks_lib.ProgressHook(
            step.step_index, step.loss, step.learning_rate, step.counters,
            self.examples_per_step, params.log_every_n_steps,
            summary_dir=params.train_dir if self._strategy.is_chief else None,
            loss_scale=step.loss_scale.scale if step.loss_scale else None,
            skip_reasons=step.totals.get("skip_reasons"),
            max_steps=params.max_steps),
        *([tower_report.LeftOutHook(step)] if step.tower_unit else []),
        *step_summaries.counters_hooks(step, params, self._strategy),
        self.give_up, self.on_signal, self.stats,
        *self._strategy.step_hooks(
            self.give_up if isinstance(
                self.give_up, checkpoint_rollback.RollbackHook) else None),
        self.state_hook,
        *[q.hook() for q in (self.quarantine, self.workers) if q],
        *extra_hooks]

  def summary(self, exit_reason=None):
    """The run summary now (an abort's has every field a normal one has)."""
    summary = _summary(
        self._params, self.stats, self.give_up, self.on_signal,
        self.state_hook.report, self.first_step_time, self._start,
        time.time(), self.examples_per_step, self._strategy, exit_reason,
        checkpoint_rollback.model_fault(self.give_up, self.explain))
    summary["forensics"] = dict(self.explain.summary(),
                                excluded_examples=self._excluded,
                                **verdict_counts.totals(self._params.train_dir))
    if self.quarantine:  # The towers this segment's step was built without.
      summary["quarantined_towers"] = list(self.quarantine.quarantined)
    if self.workers and self.workers.final is not None:
      summary["quarantined_workers"] = self.workers.final
    return summary


def _saver(params, step, state_check, state_hook, resume, lock):
  """The run's saver: finite states only, spares the last good checkpoint
  (`lock`: held while it saves, or None)."""
  # Relative paths: a copied or moved train_dir stays self-contained.
  return checkpoints.FiniteSaver(
      state_check, state_hook.refuse_save,
      var_list=checkpoint_fit.saver_var_list(resume,
                                             tf1.global_variables()),
      fresh=checkpoint_fit.fresh_variables(resume, tf1.global_variables()),
      max_to_keep=checkpoint_rollback_target.keep_checkpoint_max(params),
      save_relative_paths=True, lock=lock,
      # Pruning spares the last checkpoint before a skip streak.
      streak_start=last_good.streak_start(
          step.variables["global_step"],
          step.variables["counters"].consecutive_skips,
          params.increment_global_step_on_skip),
      # The one the give-up line names: in the run's history.
      choose=checkpoint_rollback_target.last_good_chooser(
          params, step.variables["counters"].applied_steps))


def _run_steps(step, strategy, scaffold, run, run_hooks, segments,
               quarantine):
  """Runs the step until the session stops (max_steps, a stop, a signal);
  returns whether the step is rebuilt (`quarantine`d a tower, no signal)."""
  on_signal = run.on_signal
  segments.install_signals()
  rebuild = False
  try:
    # A skip's record is appended before a checkpoint covering its step.
    with strategy.session(
        scaffold, run_hooks, lambda: on_signal.interrupted,
        first_hooks=[run.skip_line, run.explain]) as session:
      while not session.should_stop():
        strategy.run_step(session, step.train_op)
        if run.first_step_time is None:
          run.first_step_time = time.time()
    on_signal.stop_liveness()  # The ps tasks exit once all are done.
    strategy.finish()
    rebuild = segments.segment_ended(
        run.stats.steps_run, strategy.tower_config.num_towers - len(
            quarantine.quarantined if quarantine else ()),
        bool(quarantine and quarantine.restart))
  finally:
    if not rebuild:
      segments.uninstall_signals()
  return rebuild


def _summary(params, stats, give_up, on_signal, nonfinite, first_step_time,
             start, end, examples_per_step, strategy, exit_reason=None,
             model_fault=None):
  """The run summary dict of `train` (`exit_reason`: decided here if None;
  `model_fault`: the step of a model verdict the run ended on)."""
  if exit_reason is None:
    exit_reason = _exit_reason(nonfinite, give_up, on_signal, model_fault)
  final, fields = strategy.summary_fields()
  summary = run_summary.build(params, stats.latest, stats.steps_run,
                              first_step_time, start, end, examples_per_step,
                              exit_reason, final=final)
  if nonfinite:
    summary["nonfinite_state"] = nonfinite
  if model_fault is not None:
    summary["model_fault_step"] = model_fault
  summary.update(fields)
  summary.update(checkpoint_rollback.summary_fields(give_up))
  return summary


def _exit_reason(nonfinite, give_up, on_signal, model_fault=None):
  """Why a run that ended by itself (not aborted) ended."""
  if nonfinite:
    return "nonfinite_state"
  if model_fault is not None:
    return "model_fault"
  if give_up.gave_up:
    return "too_many_consecutive_skips"
  if on_signal.interrupted:
    return "interrupted"
  return "max_steps"
