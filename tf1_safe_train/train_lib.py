"""The multi-tower trainer: towers, one guarded decision, hooks, run summary.

`build_train_graph(params, tower_config)` builds the classic TF1 multi-device
step (towers -> averaged gradients -> one reduced non-finite check -> `tf.cond`
apply/skip); `train(params)` runs it under `MonitoredTrainingSession` and
writes `<train_dir>/run_summary.json`. `train(params, cluster=...)` runs one
worker of a between-graph replicated cluster (variables on the parameter
servers; asynchronous, or synchronous with `SyncReplicasOptimizer` deciding on
the aggregate) and `serve_parameter_server` one ps task.
"""

import collections
import contextlib
import time

from absl import logging
import tensorflow as tf

from tf1_safe_train import checkpoints
from tf1_safe_train import cluster as cluster_lib
from tf1_safe_train import counters as counters_lib
from tf1_safe_train import data
from tf1_safe_train import finite_state
from tf1_safe_train import guard
from tf1_safe_train import hooks as hooks_lib
from tf1_safe_train import injection
from tf1_safe_train import models
from tf1_safe_train import loss_scale as loss_scale_lib
from tf1_safe_train import optimization
from tf1_safe_train import precision
from tf1_safe_train import ps_watch
from tf1_safe_train import replicas
from tf1_safe_train import rollback
from tf1_safe_train import run_summary
from tf1_safe_train import stop_signals
from tf1_safe_train import towers
from tf1_safe_train import train_dir as train_dir_lib

tf1 = tf.compat.v1


TrainGraph = collections.namedtuple("TrainGraph", [
    "train_op", "step_index", "loss", "learning_rate", "applied", "counters",
    "tower_flags", "average_flags", "variable_names", "tower_devices",
    "global_step", "nonfinite_steps_by_tower", "max_consecutive_skips_seen",
    "sync_optimizer", "variables", "loss_scale", "loss_scale_before"
], defaults=(None, None, None, None))
TrainGraph.__doc__ = """Tensors of one training step (reads ordered after it).

With `--sync_replicas` in a cluster, `applied`, `average_flags` and
`tower_flags` are this worker's own view (True = its gradients were all
finite); the decision on the aggregate is taken by the chief's
`sync_optimizer` queue runner and shows in the counters. `variables` holds
the counter and statistics variables themselves (unordered reads).
"""


def _weight_decay_loss(rate):
  weights = [v for v in tf1.trainable_variables()
             if v.op.name.endswith("weights")]
  if not rate or not weights:
    return None
  with tf1.name_scope("weight_decay"):
    return rate * tf.add_n([tf.nn.l2_loss(w) for w in weights])


def _tower_step(params, tower_index, iterator, model_fn, optimizer, rules,
                step_index, worker_index, loss_scale=None, scale_value=None):
  """Builds tower `tower_index`: loss, gradients, non-finite flags.

  With --precision=fp16|bf16 the tower computes in that dtype on float32
  master weights; with a `loss_scale` it differentiates the loss times
  `scale_value` and divides the (float32) gradients back before the check.
  """
  images, labels = iterator.get_next()
  active, value = injection.active_value(
      rules, step_index, tower=tower_index, worker=worker_index,
      seed=params.seed)
  if params.inject_into == "input":
    images = injection.poison(images, active, value)
  compute_dtype = precision.compute_dtype(params.precision)
  if compute_dtype == tf.float32:
    logits = model_fn(images, is_training=True, num_classes=data.NUM_CLASSES)
  else:
    with precision.float32_master_weights():
      logits = model_fn(tf.cast(images, compute_dtype), is_training=True,
                        num_classes=data.NUM_CLASSES)
    logits = tf.cast(logits, tf.float32)
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=tf.cast(labels, tf.int32), logits=logits))
  decay = _weight_decay_loss(params.weight_decay)
  if decay is not None:
    loss += decay
  if params.inject_into == "loss":
    # Multiplicative, so the fault reaches the gradients as a real NaN/Inf
    # loss does (a replaced value would carry a zero gradient).
    loss *= tf.where(active, value, tf.constant(1.0))
  grads_and_vars = optimizer.compute_gradients(
      loss * scale_value if loss_scale else loss,
      var_list=tf1.trainable_variables(), colocate_gradients_with_ops=True)
  if loss_scale:
    grads_and_vars = loss_scale.unscale(grads_and_vars, scale_value)
  if params.inject_into == "grads":
    grads_and_vars = list(grads_and_vars)
    for i, (g, v) in enumerate(grads_and_vars):
      if g is not None:
        grads_and_vars[i] = (injection.poison(g, active, value), v)
        break
  flags = guard.nonfinite_flags([g for g, _ in grads_and_vars])
  return loss, grads_and_vars, flags


class _AggregateGuard(tf1.train.Optimizer):
  """What `SyncReplicasOptimizer` applies the aggregated gradients with.

  The chief's queue runner calls `apply_gradients` with the average of every
  replica's gradients (and statistics deltas): one guarded decision
  (`guard.guarded_apply`), so a NaN in any replica's contribution skips the
  update for everybody. Nothing of a forward pass runs in it.
  """

  def __init__(self, apply_fn, name="aggregate_guard"):
    super(_AggregateGuard, self).__init__(use_locking=False, name=name)
    self._apply_fn = apply_fn

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del name  # The guard names its ops.
    return guard.guarded_apply(
        grads_and_vars, self._apply_fn, global_step=global_step,
        increment_global_step_on_skip=True, update_ops=[],
        name="guarded_step").train_op


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


def build_train_graph(params, tower_config, worker_index=0, num_workers=None,
                      dataset_fn=None):
  """Builds the training step in the default graph.

  Args:
    params: validated `params.TrainParams`.
    tower_config: `towers.TowerConfig`.
    worker_index: this worker's index (fault injection selects workers; the
      input pipeline's shuffle seed is `params.seed + worker_index`).
    num_workers: None on one machine; in a cluster, its number of workers.
      Then the moving statistics are applied with the decision (see
      `rollback.statistics_deltas`) and, with `params.sync_replicas`, the
      gradients of `num_workers` replicas are aggregated by
      `SyncReplicasOptimizer` and the chief decides on the aggregate.
    dataset_fn: optional `dataset_fn(batch_size, seed)` returning the
      training `tf.data.Dataset` of (float32 images [batch_size, H, W, 3],
      int32 labels [batch_size]) batches, repeated; each tower takes its own
      batch. Default: `data.get_dataset(params.dataset, "train", ...)`.

  Returns:
    A `TrainGraph`.
  """
  rules = injection.parse_spec(params.inject_nonfinite)
  injection.validate(rules, tower_config.num_towers, num_workers or 1)
  model_fn = models.get_model(params.model)
  num_towers = tower_config.num_towers
  in_cluster = num_workers is not None
  sync = in_cluster and params.sync_replicas

  with tf1.device(tower_config.variables_device()):
    global_step = tf1.train.get_or_create_global_step()
    counters = counters_lib.skip_counters()
    # Shared by the workers of a cluster: tower i counts for tower i of
    # every worker (the skip reports name the worker).
    nonfinite_by_tower = tf1.Variable(
        tf.zeros([num_towers], tf.int64), trainable=False,
        name="nonfinite_steps_by_tower")
    max_seen = tf1.Variable(tf.constant(0, tf.int64), trainable=False,
                            name="max_consecutive_skips_seen")
    # Read once per step; injection and the reports use the same value.
    step_index = tf.identity(global_step.read_value(), name="step_index")
    schedule_step = (counters.applied_steps
                     if params.lr_schedule_step == "applied_steps"
                     else global_step)
    learning_rate = optimization.learning_rate(
        params.lr_schedule, params.learning_rate, schedule_step.read_value(),
        params.max_steps)
    optimizer = optimization.make_optimizer(params.optimizer, learning_rate)
    loss_scale, scale_value = None, None
    if params.precision == "fp16":
      loss_scale = loss_scale_lib.DynamicLossScale(
          params.initial_loss_scale, params.loss_scale_growth_steps)
      # Read once per step, before the decision that may change it.
      scale_value = tf.identity(loss_scale.scale(), name="loss_scale_value")

  with tf.device("/device:CPU:0"), tf1.name_scope("input"):
    # Each worker of a cluster shuffles its own way (worker 0 as on one
    # machine).
    seed = params.seed + worker_index
    if dataset_fn is None:
      dataset = data.get_dataset(params.dataset, "train", params.batch_size,
                                 data_dir=params.data_dir, seed=seed)
    else:
      dataset = dataset_fn(params.batch_size, seed)
    iterator = tf1.data.make_one_shot_iterator(dataset)

  tower_outputs = towers.build_towers(
      tower_config,
      lambda i: _tower_step(params, i, iterator, model_fn, optimizer, rules,
                            step_index, worker_index, loss_scale, scale_value))
  losses = [out[0] for out in tower_outputs]
  tower_flags = tf.stack([out[2] for out in tower_outputs])
  grads_and_vars = towers.average_gradients([out[1] for out in tower_outputs])
  # Like model_deploy: batch-norm statistics come from the first tower.
  update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS,
                                  tower_config.tower_scope(0))
  statistics = []
  if in_cluster:
    with tf1.device(tower_config.variables_device()):
      statistics = rollback.statistics_deltas(update_ops)
    update_ops = []
    if statistics:
      # The deltas are tower 0's: its row of the flags covers them too.
      stat_flags = guard.nonfinite_flags([d for d, _ in statistics])
      no_flags = tf.zeros_like(stat_flags)
      tower_flags = tf.concat([tower_flags, tf.stack(
          [stat_flags] + [no_flags] * (num_towers - 1))], axis=1)
  statistic_ids = set(id(v) for _, v in statistics)

  def apply_fn(checked_grads_and_vars):
    model_pairs = [(g, v) for g, v in checked_grads_and_vars
                   if id(v) not in statistic_ids]
    if params.clip_gradient_norm:
      model_pairs, _ = optimization.clip_by_global_norm(
          model_pairs, params.clip_gradient_norm)
    update = optimizer.apply_gradients(model_pairs)
    if statistics:
      writes = [v.assign_sub(d, read_value=False)
                for d, v in checked_grads_and_vars if id(v) in statistic_ids]
      with tf1.control_dependencies([update] + writes):
        # Shadows as on one machine, so checkpoints stay interchangeable.
        update = rollback.Rollback([v for _, v in statistics]).commit()
    if not params.moving_average_decay:
      return update
    ema = tf1.train.ExponentialMovingAverage(
        params.moving_average_decay, num_updates=counters.applied_steps)
    with tf1.control_dependencies([update]):
      return ema.apply(tf1.trainable_variables())

  sync_optimizer = None
  with tf1.device(tower_config.variables_device()):
    tower_nonfinite = tf.reduce_any(tower_flags, axis=1)
    pairs = list(grads_and_vars) + statistics
    if sync:
      # The chief's queue runner decides on the aggregate (_AggregateGuard);
      # this worker only pushes its gradients and waits for the sync token,
      # which comes after the decision, applied or skipped: nobody waits
      # for ever because of a skip.
      sync_optimizer = tf1.train.SyncReplicasOptimizer(
          _AggregateGuard(apply_fn), replicas_to_aggregate=num_workers,
          total_num_replicas=num_workers)
      average_flags = guard.nonfinite_flags(
          [g for g, _ in pairs if g is not None])
      step_op = sync_optimizer.apply_gradients(
          _ordered_after(pairs, step_index), global_step=global_step)
      # replicas.SyncReplicasHook runs it (a graph only inspected does not).
      sync_optimizer.ready_for_local_init_op.mark_used()
      # This replica's view only: the reports never fetch the chief's
      # decision (that would run the aggregate's apply again).
      applied = tf.logical_not(tf.logical_or(tf.reduce_any(tower_nonfinite),
                                             tf.reduce_any(average_flags)),
                               name="replica_finite")
      variable_names = [v.op.name for g, v in pairs if g is not None]
    else:
      with tf1.control_dependencies([step_index]):
        result = guard.guarded_apply(
            pairs, apply_fn, global_step=global_step,
            increment_global_step_on_skip=params.increment_global_step_on_skip,
            update_ops=update_ops,
            extra_nonfinite=tf.unstack(tower_nonfinite),
            branch_ops=[loss_scale] if loss_scale else [],
            name="guarded_step")
      step_op, applied = result.train_op, result.applied
      average_flags = result.nonfinite_flags
      variable_names = result.variable_names
      if result.update_variable_names:
        # The checked statistics are tower 0's (as in a cluster): report
        # them in its row.
        no_flags = tf.zeros_like(result.update_flags)
        tower_flags = tf.concat([tower_flags, tf.stack(
            [result.update_flags] + [no_flags] * (num_towers - 1))], axis=1)
        tower_nonfinite = tf.reduce_any(tower_flags, axis=1)
        average_flags = tf.concat([average_flags, no_flags], axis=0)
        variable_names = variable_names + result.update_variable_names
    with tf1.control_dependencies([step_op]):
      stats = [
          tf1.assign_add(nonfinite_by_tower,
                         tf.cast(tower_nonfinite, tf.int64)),
          tf1.assign(max_seen, tf.maximum(
              max_seen.read_value(), counters.consecutive_skips.read_value())),
      ]
    train_op = tf.group(step_op, *stats, name="train_op")
    after = counters_lib.read_after(counters, train_op)
    with tf1.control_dependencies([train_op]):
      global_step_after = tf.identity(global_step.read_value())
      nonfinite_after = tf.identity(nonfinite_by_tower.read_value())
      max_seen_after = tf.identity(max_seen.read_value())
    loss_scale_after = loss_scale.read_after(train_op) if loss_scale else None
    loss = tf.add_n(losses) / float(num_towers)

  graph = TrainGraph(
      train_op=train_op, step_index=step_index, loss=loss,
      learning_rate=learning_rate, applied=applied, counters=after,
      tower_flags=tower_flags, average_flags=average_flags,
      variable_names=variable_names,
      tower_devices=[tower_config.tower_device(i) for i in range(num_towers)],
      global_step=global_step_after,
      nonfinite_steps_by_tower=nonfinite_after,
      max_consecutive_skips_seen=max_seen_after,
      sync_optimizer=sync_optimizer,
      loss_scale=loss_scale_after,
      loss_scale_before=scale_value,
      variables={"global_step": global_step, "counters": counters,
                 "nonfinite_steps_by_tower": nonfinite_by_tower,
                 "max_consecutive_skips_seen": max_seen})
  _add_summaries(graph)
  return graph


def _add_summaries(graph):
  """Scalars for TensorBoard; no summary reads a gradient, so none can fail."""
  tf1.summary.scalar("loss", graph.loss)
  tf1.summary.scalar("learning_rate", graph.learning_rate)
  for name, value in graph.counters._asdict().items():
    tf1.summary.scalar("skips/" + name, value)
  for i in range(len(graph.tower_devices)):
    tf1.summary.scalar("skips/nonfinite_steps_tower_%d" % i,
                       graph.nonfinite_steps_by_tower[i])
  if graph.loss_scale is not None:
    # Tagged "loss_scale" exactly: tf1.summary.scalar would take the tag from
    # a new name scope, "loss_scale_1", as "loss_scale" holds the variable.
    tf1.add_to_collection(tf1.GraphKeys.SUMMARIES, tf.raw_ops.ScalarSummary(
        tags="loss_scale", values=tf.convert_to_tensor(graph.loss_scale.scale),
        name="loss_scale_summary"))
  for v in tf1.trainable_variables():
    # Skipped steps never write NaN, but an applied step can (a learning rate
    # too large): the histogram must not fail the step that would report it.
    # (|x| <= max is exactly "finite"; IsFinite ops stay one per gradient.)
    values = tf.reshape(v, [-1])
    finite = tf.less_equal(tf.abs(values), v.dtype.base_dtype.max)
    tf1.summary.histogram("weights/" + v.op.name,
                          tf.boolean_mask(values, finite))


TrainDirError = train_dir_lib.TrainDirError  # Its old home; train.py's.


def train(params, tower_config=None, master="", is_chief=True,
          worker_index=0, extra_hooks=(), cluster=None, dataset_fn=None):
  """Trains as `params` says and returns the run summary (a dict).

  Args:
    params: validated `params.TrainParams`.
    tower_config: `towers.TowerConfig`; default: from params (variables on the
      CPU). Ignored with `cluster` (variables go to the ps).
    master: session target ('' in-process). Ignored with `cluster`.
    is_chief: whether this process saves checkpoints and summaries. Ignored
      with `cluster` (worker 0 is the chief).
    worker_index: this worker's index. Ignored with `cluster`.
    extra_hooks: more `SessionRunHook`s.
    cluster: a `cluster.ClusterConfig` whose job is 'worker', to train as
      that worker of the cluster (this process starts its gRPC server).
    dataset_fn: optional input pipeline in place of `params.dataset`'s (see
      `build_train_graph`).

  Returns:
    The dict also written to `run_summary.json` (by the chief).

  Raises:
    cluster.ClusterError: if this task's server cannot start, or
      (`ClusterUnreachableError`) a ps does not answer within
      `params.startup_timeout_secs`.
  """
  params.validate()
  num_workers, server, sync = 1, None, False
  if cluster is not None:
    if cluster.job_name != cluster_lib.WORKER:
      raise ValueError("train() runs a worker; %s runs "
                       "serve_parameter_server" % cluster.task_name)
    is_chief, worker_index = cluster.is_chief, cluster.task_index
    num_workers, sync = cluster.num_workers, params.sync_replicas
    tower_config = replicas.cluster_tower_config(params, cluster)
  elif tower_config is None:
    tower_config = towers.TowerConfig(params.num_towers, params.device)
  if is_chief:
    train_dir_lib.check(params.train_dir)
  if cluster is not None:
    cluster_lib.wait_for_ps(cluster, params.startup_timeout_secs)
    server = replicas.start_server(cluster, params)
    master = server.target
    logging.info("%s of %s at %s (%s)", cluster.task_name,
                 cluster.cluster, cluster.address,
                 "synchronous replicas" if sync else "asynchronous replicas")
  start = time.time()
  with tf.Graph().as_default(), contextlib.ExitStack() as owned:
    tf1.set_random_seed(params.seed)
    with (tf1.device(replicas.worker_device(cluster)) if cluster is not None
          else contextlib.nullcontext()):
      graph = build_train_graph(params, tower_config, worker_index,
                                num_workers if cluster else None,
                                dataset_fn=dataset_fn)
      end_ops = replicas.end_of_run_ops(cluster, graph) if cluster else None
    if cluster is not None:
      graph = graph._replace(tower_devices=[
          replicas.worker_device(cluster) + d for d in graph.tower_devices])
    examples_per_step = params.batch_size * tower_config.num_towers
    progress = hooks_lib.ProgressHook(
        graph.step_index, graph.loss, graph.learning_rate, graph.counters,
        examples_per_step, params.log_every_n_steps,
        summary_dir=params.train_dir if is_chief else None,
        loss_scale=graph.loss_scale.scale if graph.loss_scale else None)
    skip_report = hooks_lib.SkipReportHook(
        graph.step_index, graph.applied, graph.tower_flags,
        graph.average_flags, graph.variable_names, graph.tower_devices,
        loss_scale=graph.loss_scale_before)
    # With a loss scale, skips that halve it are expected overflows; only
    # skips at the floor scale are faults that count toward giving up.
    give_up = hooks_lib.GiveUpHook(
        graph.loss_scale.floor_skips if graph.loss_scale
        else graph.counters.consecutive_skips, params.max_consecutive_skips)
    on_signal = stop_signals.StopOnSignalHook(
        on_abort=lambda reason: is_chief and stop_signals.write_abort_summary(
            params.train_dir, run_summary.build(
                params, stats.latest, stats.steps_run, first_step_time,
                start, time.time(), examples_per_step, "aborted"), reason),
        liveness=ps_watch.ParameterServerWatch(
            cluster, params.startup_timeout_secs) if cluster else None,
        stop_grace_secs=replicas.SIGNAL_GRACE_SECS if cluster else None)
    stats = hooks_lib.RunStatsHook({
        "global_step": graph.global_step, "loss": graph.loss,
        "counters": graph.counters,
        "nonfinite_steps_by_tower": graph.nonfinite_steps_by_tower,
        "max_consecutive_skips_seen": graph.max_consecutive_skips_seen,
        **({"loss_scale": graph.loss_scale.scale} if graph.loss_scale
           else {})})
    run_hooks = [hooks_lib.StopAtStepHook(params.max_steps),
                 progress, skip_report, give_up, on_signal, stats]
    if graph.sync_optimizer is not None:
      run_hooks.append(
          replicas.SyncReplicasHook(graph.sync_optimizer, is_chief))
    state_check = finite_state.FiniteStateCheck()
    state_hook = finite_state.NonFiniteStateHook(
        state_check, graph.step_index, graph.applied,
        finite_state.likely_cause(params))
    run_hooks += [state_hook] + list(extra_hooks)
    # Relative paths: a copied or moved train_dir stays self-contained.
    saver = checkpoints.FiniteSaver(state_check, state_hook.refuse_save,
                                    max_to_keep=5, save_relative_paths=True)
    scaffold = tf1.train.Scaffold(saver=saver)
    if is_chief:
      owned.enter_context(train_dir_lib.lock(params.train_dir))
      checkpoints.prepare_resume(params.train_dir, tf1.global_variables(),
                                 params)
    end_hook = None
    if cluster is None:
      make_session = lambda: tf1.train.MonitoredTrainingSession(
          master=master, is_chief=is_chief, checkpoint_dir=params.train_dir,
          scaffold=scaffold, hooks=run_hooks,
          save_checkpoint_steps=params.save_checkpoints_steps,
          save_summaries_steps=params.save_summaries_steps,
          log_step_count_steps=None,
          config=towers.session_config(tower_config))
    else:
      session_config = replicas.cluster_session_config(tower_config, cluster)
      end_hook = replicas.EndOfRunHook(cluster, end_ops,
                                       lambda: on_signal.interrupted,
                                       replicas.END_WAIT_SECS)
      make_session = lambda: replicas.cluster_session(
          params, cluster, master, session_config, scaffold,
          [end_hook] + run_hooks)
    on_signal.install()
    first_step_time = None
    try:
      with make_session() as session:
        while not session.should_stop():
          session.run(graph.train_op)
          if first_step_time is None:
            first_step_time = time.time()
      if cluster is not None:
        on_signal.stop_liveness()  # The ps tasks exit once all are done.
        replicas.report_done(server, end_ops, session_config,
                     params.startup_timeout_secs)
    finally:
      on_signal.uninstall()
    end = time.time()
    summary = _summary(params, stats, give_up, on_signal, state_hook.report,
                       first_step_time, start, end, examples_per_step,
                       end_hook, cluster, sync)
    if is_chief:  # Under the lock, as every write of the run.
      run_summary.write(params.train_dir, summary)
  return summary


def _summary(params, stats, give_up, on_signal, nonfinite, first_step_time,
             start, end, examples_per_step, end_hook, cluster, sync):
  """The run summary dict of `train`."""
  if nonfinite:
    exit_reason = "nonfinite_state"
  elif give_up.gave_up:
    exit_reason = "too_many_consecutive_skips"
  elif on_signal.interrupted:
    exit_reason = "interrupted"
  else:
    exit_reason = "max_steps"
  summary = run_summary.build(params, stats.latest, stats.steps_run,
                              first_step_time, start, end, examples_per_step,
                              exit_reason,
                              final=end_hook.final if end_hook else None)
  if nonfinite:
    summary["nonfinite_state"] = nonfinite
  if cluster is not None:
    summary["cluster"] = {"num_ps": cluster.num_ps,
                          "num_workers": cluster.num_workers,
                          "task": cluster.task_name,
                          "sync_replicas": sync}
  return summary
