"""The trainer's runner: the session, its hooks, the run summary.

`train(params)` builds the step (`train_step.build_step`) as the run's
replication strategy places and decides it (`replication`: one process, or
one worker of a between-graph cluster, asynchronous or synchronous), runs it
under a MonitoredSession until the run ends and writes
`<train_dir>/run_summary.json`.
"""

import contextlib
import time

from absl import logging
import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train.cluster import replication
from tf1_safe_train.trainer import checkpoint_fit
from tf1_safe_train.trainer import checkpoints
from tf1_safe_train.trainer import exclusion
from tf1_safe_train.trainer import finite_state
from tf1_safe_train.trainer import forensics
from tf1_safe_train.trainer import hooks as hooks_lib
from tf1_safe_train.trainer import last_good
from tf1_safe_train.trainer import params as params_lib
from tf1_safe_train.trainer import quarantine as quarantine_lib
from tf1_safe_train.trainer import recovery
from tf1_safe_train.trainer import run_summary
from tf1_safe_train.trainer import stop_signals
from tf1_safe_train.trainer import tower_report
from tf1_safe_train.trainer import tower_unit
from tf1_safe_train.trainer import train_dir as train_dir_lib
from tf1_safe_train.trainer import train_step

tf1 = tf.compat.v1


TrainDirError = train_dir_lib.TrainDirError  # Its old home; train.py's.


def train(params, cluster=None, extra_hooks=(), dataset_fn=None,
          strategy=None):
  """Trains as `params` says and returns the run summary (a dict).

  Args:
    params: validated `params.TrainParams`.
    cluster: a `cluster.ClusterConfig` whose job is 'worker', to train as
      that worker of the cluster (this process starts its gRPC server).
    extra_hooks: more `SessionRunHook`s, run after the trainer's.
    dataset_fn: optional input pipeline in place of `params.dataset`'s (see
      `train_step.build_step`).
    strategy: a `replication` strategy in place of the one `params` and
      `cluster` make (`replication.make`), e.g. `replication.Local` with
      other towers or another session target.

  Returns:
    The dict also written to `run_summary.json` (by the chief).

  Raises:
    cluster.ClusterError: if this task's server cannot start, or
      (`ClusterUnreachableError`) a ps does not answer within
      `params.startup_timeout_secs`.
  """
  clear = params.clear_quarantine
  while True:
    # A tower quarantined ends a segment: the step is rebuilt without it,
    # from the checkpoint the segment's end saved (`quarantine`).
    summary, restart = _train(params, cluster, extra_hooks, dataset_fn,
                              strategy, clear)
    if not restart:
      return summary
    clear = False


def _train(params, cluster, extra_hooks, dataset_fn, strategy, clear):
  """`train`'s one segment: (run summary, restart: a tower quarantined)."""
  params.validate()
  strategy = strategy or replication.make(params, cluster)
  if strategy.in_cluster and recovery.refusal_in_cluster(params):
    raise params_lib.ParamsError(recovery.refusal_in_cluster(params))
  if strategy.in_cluster and tower_unit.refusal_in_cluster(params):
    raise params_lib.ParamsError(tower_unit.refusal_in_cluster(params))
  is_chief = strategy.is_chief
  if is_chief:
    train_dir_lib.check(params.train_dir)
  strategy.start()
  start = time.time()
  exclude_ids, excluded = exclusion.excluded(
      params.train_dir if params.exclude_reproducible_skips else None,
      None if dataset_fn else lambda: data.split_ids(
          params.dataset, "train", params.data_dir), params.batch_size)
  line = exclusion.describe(excluded)
  if line:
    logging.info(line)
  quarantine = (quarantine_lib.Quarantine(
      params, strategy.tower_devices(), max(2, tower_unit.min_healthy(
          params.min_healthy_towers, params.num_towers)), clear)
                if params.quarantine_after else None)
  with tf.Graph().as_default(), contextlib.ExitStack() as owned:
    tf1.set_random_seed(params.seed)
    with strategy.device():
      step = train_step.build_step(
          params, strategy, dataset_fn=dataset_fn, exclude_ids=exclude_ids,
          quarantined=quarantine.quarantined if quarantine else ())
      strategy.after_build(step)
      if quarantine:
        quarantine.build(strategy.tower_config.variables_device())
    explain = forensics.ForensicsHook(
        step, params, strategy.worker_index, params.max_explained_skips,
        summary_dir=params.train_dir if is_chief else None,
        describe_id=lambda i: data.describe_id(
            params.dataset if dataset_fn is None else "dataset_fn", i),
        # On one machine only: in a cluster one worker's stop would leave
        # the others waiting; its streak ends the run there. (`give_up` is
        # made below, before the session runs.)
        on_model=None if strategy.in_cluster else (
            lambda context, at: recovery.act_on_model_fault(
                give_up, context, at)),
        quarantine=quarantine)
    examples_per_step = params.batch_size * strategy.tower_config.num_towers
    first_step_time = None
    stats = hooks_lib.RunStatsHook(dict(
        step.totals, loss=step.loss,
        **({"loss_scale": step.loss_scale.scale} if step.loss_scale else {})))
    # With a loss scale, skips that halve it are expected overflows; only
    # skips at the floor scale are faults that count toward giving up.
    # (Or rolls back instead: `recovery`.)
    give_up = recovery.give_up_hook(
        params, step.loss_scale.floor_skips if step.loss_scale
        else step.counters.consecutive_skips, step)

    def full_summary(exit_reason=None):
      """The run summary now (an abort's has every field a normal one has)."""
      summary = _summary(params, stats, give_up, on_signal, state_hook.report,
                         first_step_time, start, time.time(),
                         examples_per_step, strategy, exit_reason,
                         recovery.model_fault(give_up, explain))
      summary["forensics"] = dict(explain.summary(),
                                  excluded_examples=excluded,
                                  **forensics.totals(params.train_dir))
      if quarantine:  # The towers this segment's step was built without.
        summary["quarantined_towers"] = list(quarantine.quarantined)
      return summary

    on_signal = stop_signals.StopOnSignalHook(
        on_abort=lambda reason: is_chief and stop_signals.write_abort_summary(
            params.train_dir, full_summary("aborted"), reason),
        liveness=strategy.liveness,
        stop_grace_secs=strategy.stop_grace_secs)
    state_check = finite_state.FiniteStateCheck()
    state_hook = finite_state.NonFiniteStateHook(
        state_check, step.step_index, step.applied,
        finite_state.likely_cause(params))
    report = step.report
    # The order the hooks run in (the strategy puts its own around them).
    run_hooks = [
        hooks_lib.StopAtStepHook(params.max_steps),
        hooks_lib.ProgressHook(
            step.step_index, step.loss, step.learning_rate, step.counters,
            examples_per_step, params.log_every_n_steps,
            summary_dir=params.train_dir if is_chief else None,
            loss_scale=step.loss_scale.scale if step.loss_scale else None,
            skip_reasons=step.totals.get("skip_reasons"),
            max_steps=params.max_steps),
        hooks_lib.SkipReportHook(
            step.step_index, step.applied, report.tower_flags,
            report.average_flags, report.variable_names, report.tower_devices,
            loss_scale=step.loss_scale_before, spikes=step.spikes),
        *([tower_report.LeftOutHook(step)] if step.tower_unit else []),
        give_up, on_signal, stats,
        *strategy.step_hooks(),
        state_hook,
        *([quarantine.hook()] if quarantine else []),
        *extra_hooks]
    resume = None
    if is_chief:
      owned.enter_context(train_dir_lib.lock(params.train_dir))
      resume = checkpoints.prepare_resume(params.train_dir,
                                          tf1.global_variables(), params)
    # Relative paths: a copied or moved train_dir stays self-contained.
    saver = checkpoints.FiniteSaver(
        state_check, state_hook.refuse_save,
        var_list=checkpoint_fit.saver_var_list(resume,
                                               tf1.global_variables()),
        fresh=checkpoint_fit.fresh_variables(resume, tf1.global_variables()),
        max_to_keep=recovery.keep_checkpoint_max(params),
        save_relative_paths=True,
        # Pruning spares the last checkpoint before a skip streak.
        streak_start=last_good.streak_start(
            step.variables["global_step"],
            step.variables["counters"].consecutive_skips,
            params.increment_global_step_on_skip))
    if isinstance(give_up, recovery.RollbackHook):
      give_up.attach(resume)
    scaffold = tf1.train.Scaffold(saver=saver)
    on_signal.install()
    try:
      # A skip's record is appended before a checkpoint covering its step.
      with strategy.session(scaffold, run_hooks,
                            lambda: on_signal.interrupted,
                            first_hooks=[explain]) as session:
        while not session.should_stop():
          session.run(step.train_op)
          if first_step_time is None:
            first_step_time = time.time()
      on_signal.stop_liveness()  # The ps tasks exit once all are done.
      strategy.finish()
    finally:
      on_signal.uninstall()
    summary = full_summary()
    if is_chief:  # Under the lock, as every write of the run.
      run_summary.write(params.train_dir, summary)
  return summary, bool(quarantine and quarantine.restart)


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
  summary.update(recovery.summary_fields(give_up))
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
