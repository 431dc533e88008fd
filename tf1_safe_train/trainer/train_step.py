"""The trainer's step: towers -> averaged gradients -> one guarded decision.

`tower_loss_and_grads` computes one tower's loss and gradients (input ->
model -> loss -> loss scale -> gradients -> drill); `build_step` builds the
whole step in the default graph and returns a `Step`.

A gradient's path, module by module (four; it never enters the runner,
`train_lib`, nor the strategy, `replication`, which only chooses what the
gradients are applied with):
  1. `train_step.tower_loss_and_grads`: computed in its tower
     (`DynamicLossScale.gradients` scales, differentiates, unscales; the
     drill's `TowerDrill.grads` may poison it);
  2. `towers.average_gradients`: averaged over the towers;
  3. `optimizer.SkipNonFiniteOptimizer.apply_gradients`, the library's one
     guarded step (the public wrapper), called here (`build_step`) or, with
     sync replicas, by TF's `SyncReplicasOptimizer` on the chief with the
     aggregate of every worker's;
  4. `guard.guarded_apply`: checked, then the `tf.cond` whose apply branch
     calls back `applied_update.AppliedUpdate.apply_gradients` (clip, apply,
     statistics, EMA).
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import loss_scale as loss_scale_lib
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import spikes as spikes_lib
from tf1_safe_train import data
from tf1_safe_train import models
from tf1_safe_train.trainer import applied_update
from tf1_safe_train.trainer import drill as drill_lib
from tf1_safe_train.trainer import optimization
from tf1_safe_train.trainer import precision
from tf1_safe_train.trainer import recovery
from tf1_safe_train.trainer import replay_lib
from tf1_safe_train.trainer import step_summaries
from tf1_safe_train.trainer import tower_input
from tf1_safe_train.trainer import tower_unit as tower_unit_lib
from tf1_safe_train.trainer import towers

tf1 = tf.compat.v1

Step = collections.namedtuple("Step", [
    "train_op", "step_index", "loss", "learning_rate", "applied", "counters",
    "report", "totals", "loss_scale", "loss_scale_before", "variables",
    "spikes", "forensics", "tower_unit"], defaults=(None,))
Step.__doc__ = """Tensors of one training step (reads ordered after it).

Attributes:
  train_op: runs the step.
  step_index: global_step read before the step (the drill's and reports').
  loss, learning_rate: float32 scalars.
  applied: bool scalar; with sync replicas this worker's own view (True =
    its gradients were all finite), the aggregate's decision shows in the
    counters.
  counters: `counters.SkipCounters` read after the step.
  report: `SkipReport` of the step (what `hooks.SkipReportHook` fetches).
  totals: dict of reads after the step for the run summary: global_step,
    counters, nonfinite_steps_by_tower, max_consecutive_skips_seen.
  loss_scale: `loss_scale.LossScaleState` read after the step, or None.
  loss_scale_before: the scale the step's loss was multiplied by, or None.
  variables: the state variables themselves (unordered reads): global_step,
    counters, nonfinite_steps_by_tower, max_consecutive_skips_seen.
  spikes: with --skip_spikes_sigma, the decision's `spikes.SpikeReport`
    (None with sync replicas: the chief decides), else None.
  forensics: `replay_lib.Forensics` (batch store, per-tower probes), what
    explains a skip after the step.
  tower_unit: with --skip_unit=tower, the step's `tower_unit.TowerUnit`
    (which towers it left out), else None.
"""

SkipReport = collections.namedtuple("SkipReport", [
    "tower_flags", "average_flags", "variable_names", "tower_devices"])
SkipReport.__doc__ = """What a skipped step's report line is made of.

Attributes:
  tower_flags: bool [num_towers], one fused flag per tower (True = some
    gradient of that tower was non-finite).
  average_flags: bool [len(variable_names)], the decision's per-variable
    flags of the averaged gradients (which name the variables: a NaN/Inf of
    any tower survives averaging).
  variable_names, tower_devices: Python lists.
"""


def tower_loss_and_grads(params, images, labels, model_fn, optimizer,
                         tower_drill, loss_scale=None, scale=None):
  """One tower's loss and (float32, unscaled) gradients.

  `images` are as the model reads them (after the input drill, which models
  data: the batch store and a replay see the poisoned batch).

  With --precision=fp16|bf16 the tower computes in that dtype on float32
  master weights; with a `loss_scale` it differentiates the loss times
  `scale` and divides the gradients back (`DynamicLossScale.gradients`).
  """
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
  decay = optimization.weight_decay_loss(params.weight_decay)
  if decay is not None:
    loss += decay
  loss = tower_drill.loss(loss)
  kwargs = dict(var_list=tf1.trainable_variables(),
                colocate_gradients_with_ops=True)
  if loss_scale is None:
    grads_and_vars = optimizer.compute_gradients(loss, **kwargs)
  else:
    grads_and_vars = loss_scale.gradients(optimizer.compute_gradients, loss,
                                          scale, **kwargs)
  return loss, tower_drill.grads(grads_and_vars)


def _or_tower0(tower_nonfinite, flag):
  """`tower_nonfinite`, tower 0's flag or-ed with `flag` (statistics
  come from tower 0, as in model_deploy: its flag reports them)."""
  return tf.concat([tf.logical_or(tower_nonfinite[:1], flag),
                    tower_nonfinite[1:]], axis=0)


def _spike_config(params):
  if not params.skip_spikes_sigma:
    return None  # The graph is exactly the one without the option.
  return spikes_lib.SpikeConfig(
      params.skip_spikes_sigma, params.spike_warmup_steps,
      params.spike_max_streak, params.skip_loss_spikes)


def build_step(params, strategy, dataset_fn=None, exclude_ids=(),
               quarantined=()):
  """Builds the training step in the default graph.

  Args:
    params: validated `params.TrainParams`.
    strategy: the run's `replication` strategy (placement, decision).
    dataset_fn: optional `dataset_fn(batch_size, seed)` returning the
      training `tf.data.Dataset` of (float32 images [batch_size, H, W, 3],
      int32 labels [batch_size]) batches, repeated; each tower takes its own
      batch. Default: `data.get_dataset(params.dataset, "train", ...)`.
      Batches may carry example ids as a third element (`data.with_ids`).
    exclude_ids: example ids the input never yields (`exclusion`).
    quarantined: indices of towers not built (`quarantine`; only with
      --skip_unit=tower): no node of theirs runs, no input is read.

  Returns:
    A `Step`.
  """
  config = strategy.tower_config
  num_towers = config.num_towers
  drill = drill_lib.Drill.of(params, num_towers, strategy.num_workers)
  model_fn = models.get_model(params.model)

  with tf1.device(config.variables_device()):
    global_step = tf1.train.get_or_create_global_step()
    counters = counters_lib.skip_counters()
    # Shared by the workers of a cluster: tower i counts for tower i of
    # every worker (the skip reports name the worker).
    nonfinite_by_tower = tf1.Variable(
        tf.zeros([num_towers], tf.int64), trainable=False,
        name="nonfinite_steps_by_tower")
    max_seen = tf1.Variable(tf.constant(0, tf.int64), trainable=False,
                            name="max_consecutive_skips_seen")
    # Read once per step; the drill and the reports use the same value.
    step_index = tf.identity(global_step.read_value(), name="step_index")
    schedule_step = (counters.applied_steps
                     if params.lr_schedule_step == "applied_steps"
                     else global_step)
    learning_rate = optimization.learning_rate(
        params.lr_schedule, params.learning_rate, schedule_step.read_value(),
        params.max_steps)
    learning_rate = recovery.scale_learning_rate(params, learning_rate)
    optimizer = optimization.make_optimizer(params.optimizer, learning_rate)
    loss_scale, scale = None, None
    if params.precision == "fp16":
      loss_scale = loss_scale_lib.DynamicLossScale(
          params.initial_loss_scale, params.loss_scale_growth_steps)
      # Read once per step, before the decision that may change it.
      scale = tf.identity(loss_scale.scale(), name="loss_scale_value")

  tower_inputs = tower_input.TowerInput(params, strategy.worker_index,
                                        num_towers, dataset_fn, exclude_ids)
  devices = strategy.tower_devices()
  probes = {}

  def tower_fn(i):
    tower_drill = drill.tower(step_index, i, strategy.worker_index)
    images, labels = tower_inputs.read(i, tower_drill)
    loss, grads_and_vars = tower_loss_and_grads(
        params, images, labels, model_fn, optimizer, tower_drill, loss_scale,
        scale)
    probes[i] = replay_lib.tower_probe(i, devices[i], images, labels, loss,
                                       grads_and_vars, tower_drill)
    # Good steps pay for the decision only: the averaged gradients' checks
    # (a NaN/Inf of any tower survives averaging) name the variables, and
    # each tower adds one fused flag, which keeps the tower of a fault that
    # would not reproduce. One tower's gradients are the averaged ones: its
    # flag is the decision's (below).
    flag = (nonfinite.any_nonfinite([g for g, _ in grads_and_vars])
            if num_towers > 1 else None)
    return loss, grads_and_vars, flag

  outputs = towers.build_towers(config, tower_fn, skip=quarantined)
  built = sorted(probes)
  unit = tower_unit_lib.of_towers(params, outputs, config.variables_device(),
                                  built)
  grads_and_vars = (unit.average_gradients() if unit else
                    towers.average_gradients([gv for _, gv, _ in outputs]))
  # Like model_deploy: batch-norm statistics come from the first tower.
  statistics, update_ops = strategy.statistics(tf1.get_collection(
      tf1.GraphKeys.UPDATE_OPS, config.tower_scope(built[0])))
  if unit:
    tower_nonfinite = unit.left_out  # Its loss too.
  elif num_towers > 1:
    tower_nonfinite = tf.stack([flag for _, _, flag in outputs])
    if statistics:
      tower_nonfinite = _or_tower0(
          tower_nonfinite, nonfinite.any_nonfinite([d for d, _ in statistics]))
  else:
    # The worker's own view in a cluster checks these gradients anyway.
    tower_nonfinite = tf.zeros([1], tf.bool)

  # The one guarded step of the library (the public wrapper), deciding
  # where the strategy says: here, or on the chief for the aggregate.
  guarded = optimizer_lib.SkipNonFiniteOptimizer(
      applied_update.AppliedUpdate(params, optimizer, statistics,
                                   counters.applied_steps),
      increment_global_step_on_skip=params.increment_global_step_on_skip,
      update_ops=update_ops, loss_scale=loss_scale, name="guarded_step",
      skip_spikes=_spike_config(params),
      # The trainer builds the whole step itself and checks it by its
      # tests: no first-run check (`run_check`), which would cost a dict
      # lookup per run and name its own counters' writes.
      check_runs=False, tower_unit=unit)
  with tf1.device(config.variables_device()):
    loss = unit.loss if unit else (
        tf.add_n([loss for loss, _, _ in outputs]) / float(len(outputs)))
    pairs = list(grads_and_vars) + statistics
    # (Loss spikes are refused with sync replicas, whose apply has no loss.)
    kwargs = dict(loss=loss) if params.skip_loss_spikes else {}
    with tf1.control_dependencies([step_index]):
      step_op = strategy.decider(guarded).apply_gradients(
          pairs, global_step=global_step, **kwargs)
    result = strategy.result(guarded, pairs, tower_nonfinite)
    average_flags, names = result.nonfinite_flags, result.variable_names
    if result.update_variable_names:
      # The checked statistics are tower 0's (as in a cluster).
      tower_nonfinite = _or_tower0(tower_nonfinite,
                                   tf.reduce_any(result.update_flags))
      average_flags = tf.concat([average_flags, result.update_flags], axis=0)
      names = names + result.update_variable_names
    if num_towers == 1:
      tower_nonfinite = tf.reshape(tf.reduce_any(average_flags), [1])
    with tf1.control_dependencies([step_op]):
      totals = [
          tf1.assign_add(nonfinite_by_tower,
                         tf.cast(tower_nonfinite, tf.int64)),
          tf1.assign(max_seen, tf.maximum(
              max_seen.read_value(), counters.consecutive_skips.read_value())),
      ]
    # A left-out tower 0's batch is no control batch (`batch_store`).
    keep = tower_inputs.keep_if_applied(
        tf.logical_and(result.applied, unit.keep_updates) if unit
        else result.applied, step_index)
    train_op = tf.group(step_op, keep, *totals, name="train_op")
    after = counters_lib.read_after(counters, train_op)
    with tf1.control_dependencies([train_op]):
      totals = {
          "global_step": tf.identity(global_step.read_value()),
          "counters": after,
          "nonfinite_steps_by_tower": tf.identity(
              nonfinite_by_tower.read_value()),
          "max_consecutive_skips_seen": tf.identity(max_seen.read_value())}
      if unit:
        totals[tower_unit_lib.REJECTED] = tf.identity(
            unit.rejected.read_value())
      if params.skip_spikes_sigma:
        # The variables, not the decision's report: a sync worker reads
        # the chief's counts too.
        totals["skip_reasons"] = spikes_lib.read_reasons(
            counters.skipped_steps, train_op)

  step = Step(
      train_op=train_op, step_index=step_index, loss=loss,
      learning_rate=learning_rate, applied=result.applied, counters=after,
      report=SkipReport(tower_nonfinite, average_flags, names, devices),
      totals=totals,
      loss_scale=loss_scale.read_after(train_op) if loss_scale else None,
      loss_scale_before=scale,
      variables={"global_step": global_step, "counters": counters,
                 "nonfinite_steps_by_tower": nonfinite_by_tower,
                 "max_consecutive_skips_seen": max_seen},
      spikes=result.spikes,
      # (None for a quarantined tower.)
      forensics=replay_lib.Forensics(
          tower_inputs.store, [probes.get(i) for i in range(num_towers)],
          scale),
      tower_unit=unit)
  step_summaries.add(step)
  return step
