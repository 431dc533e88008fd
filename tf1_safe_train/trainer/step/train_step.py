"""The trainer's step: towers -> averaged gradients -> one guarded decision.

`tower_loss.tower_loss_and_grads` computes one tower's loss and gradients
(input -> model -> loss -> loss scale -> gradients -> drill); `build_step`
builds the whole step in the default graph and returns a `Step`.

A gradient's path, module by module (four; it never enters the runner,
`train_lib`, nor the strategy, `replication`, which only chooses what the
gradients are applied with):
  1. `tower_loss.tower_loss_and_grads`: computed in its tower
     (`DynamicLossScale.gradients` scales, differentiates, unscales; the
     drill's `TowerDrill.grads` may poison it);
  2. `towers.average_gradients`: averaged over the towers (with
     --skip_unit=tower, `tower_unit.TowerUnit.average_gradients`: over the
     healthy ones);
  3. `optimizer.SkipNonFiniteOptimizer.apply_gradients_with_result`, the
     library's one guarded step (the public wrapper), called by the
     strategy's `decide` (its result returned) or, with sync replicas, by
     TF's `SyncReplicasOptimizer` on the chief with every worker's;
  4. `guard.decide`: checked, then the `tf.cond` whose apply branch
     calls back `applied_update.AppliedUpdate.apply_gradients` (clip, apply,
     statistics, EMA).
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import criterion_registry
from tf1_safe_train.core import loss_scale as loss_scale_lib
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import norms
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import tower_outliers
from tf1_safe_train import models
from tf1_safe_train.trainer.step import applied_update
from tf1_safe_train.trainer.recovery import checkpoint_rollback_state
from tf1_safe_train.trainer.drills import drill as drill_lib
from tf1_safe_train.trainer.step import optimization
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.step import step_state
from tf1_safe_train.trainer.step import step_summaries
from tf1_safe_train.trainer.inputs import tower_input
from tf1_safe_train.trainer.step import tower_loss
from tf1_safe_train.trainer.tower import tower_unit as tower_unit_lib
from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1

Step = collections.namedtuple("Step", [
    "train_op", "step_index", "loss", "learning_rate", "applied", "counters",
    "report", "totals", "loss_scale", "loss_scale_before", "variables",
    "reasons", "forensics", "tower_unit", "worker_unit"],
    defaults=(None, None))
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
    counters, nonfinite_steps_by_tower, max_consecutive_skips_seen,
    skip_reasons (each reason's counters: `reasons.Report.counts`).
  loss_scale: `loss_scale.LossScaleState` read after the step, or None.
  loss_scale_before: the scale the step's loss was multiplied by, or None.
  variables: the state variables themselves (unordered reads): global_step,
    counters, nonfinite_steps_by_tower, max_consecutive_skips_seen.
  reasons: the decision's `reasons.Report` (each criterion's flag and
    values; the label of a skip), None with sync replicas (the chief
    decides).
  forensics: `replay_lib.Forensics` (batch store, per-tower probes), what
    records and explains a skip after the step (no probes where the run
    cannot replay: `Forensics.replays`).
  tower_unit: with --skip_unit=tower, the step's `tower_unit.TowerUnit`
    (which towers it left out), else None.
  worker_unit: with --skip_unit=worker (a sync cluster), the strategy's
    `cluster.worker_unit.WorkerUnit` (which workers the chief left out),
    else None.
"""

SkipReport = collections.namedtuple("SkipReport", [
    "tower_flags", "average_flags", "variable_names", "tower_devices"])
SkipReport.__doc__ = """What a skipped step's report line is made of.

Attributes:
  tower_flags: bool [num_towers], one fused flag per tower (True = some
    gradient of that tower was non-finite).
  average_flags: bool [len(variable_names)], the decision's per-variable
    flags of the averaged gradients (which name the variables: a NaN/Inf of
    any tower survives averaging; --skip_unit=tower: or of a left-out one).
  variable_names, tower_devices: Python lists.
"""


def _or_tower0(tower_nonfinite, flag):
  """`tower_nonfinite`, tower 0's flag or-ed with `flag` (statistics
  come from tower 0, as in model_deploy: its flag reports them)."""
  return tf.concat([tf.logical_or(tower_nonfinite[:1], flag),
                    tower_nonfinite[1:]], axis=0)


Towers = collections.namedtuple("Towers", [
    "outputs", "grads_and_vars", "statistics", "update_ops", "nonfinite",
    "inputs", "probes", "devices", "unit", "indices", "gauges"])
Towers.__doc__ = """The towers of one step, built (`_build_towers`): per
tower built (loss, grads_and_vars, fused non-finite flag or None), the
average, the first tower's statistics and update ops, the towers' flags,
input, replay probes (None for a quarantined tower), devices, the
`tower_unit.TowerUnit` (--skip_unit=tower) or None, the built towers'
indices, and a function building their gauges once (`_tower_gauges`)."""


def _optimizer(params, state):
  """(learning rate, optimizer, loss scale or None, its value or None)."""
  schedule_step = (state.counters.applied_steps
                   if params.lr_schedule_step == "applied_steps"
                   else state.global_step)
  learning_rate = optimization.learning_rate(
      params.lr_schedule, params.learning_rate, schedule_step.read_value(),
      params.max_steps)
  learning_rate = checkpoint_rollback_state.scale_learning_rate(
      params, learning_rate)
  optimizer = optimization.make_optimizer(params.optimizer, learning_rate)
  loss_scale, scale = None, None
  if params.precision == "fp16":
    loss_scale = loss_scale_lib.DynamicLossScale(
        params.initial_loss_scale, params.loss_scale_growth_steps,
        hysteresis=params.loss_scale_hysteresis)
    # Read once per step, before the decision that may change it.
    scale = tf.identity(loss_scale.scale(), name="loss_scale_value")
  return learning_rate, optimizer, loss_scale, scale


def _build_towers(params, strategy, step_index, optimizer, loss_scale, scale,
                  dataset_fn, exclude_ids, quarantined, replays, skip_batches,
                  outliers=None):
  """Every tower's input, loss and gradients, averaged: `Towers` (with
  replay probes if `replays`; with --skip_unit=tower, `outliers`' towers,
  a `tower_outliers.TowerOutliers`, left out too)."""
  config = strategy.tower_config
  num_towers = config.num_towers
  drill = drill_lib.Drill.of(params, num_towers, strategy.num_workers)
  model_fn = models.get_model(params.model)
  tower_inputs = tower_input.TowerInput(params, strategy.worker_index,
                                        num_towers, dataset_fn, exclude_ids,
                                        skip_batches)
  devices = strategy.tower_devices()
  probes = {}
  gauges = {}  # What each tower's batch explains of its gradient norm.
  # An outlier named (3 towers or more) gets a replay of its own.
  replay_outliers = (replays and outliers is not None and
                     not outliers.dry_run and num_towers >= 3)

  def tower_fn(i):
    tower_drill = drill.tower(step_index, i, strategy.worker_index)
    images, labels = tower_inputs.read(i, tower_drill)
    loss, grads_and_vars, gauges[i] = tower_loss.tower_loss_and_grads(
        params, images, labels, model_fn, optimizer, tower_drill, loss_scale,
        scale)
    probes[i] = replay_lib.tower_probe(
        i, devices[i], images, labels, loss, grads_and_vars, tower_drill,
        build_probe=replays,
        # What an outlier's replay fetches (`outlier_replay`); no step does.
        grad_norm=norms.fused_global_norm([g for g, _ in grads_and_vars])
        if replay_outliers else None,
        gauge=gauges[i]() if replay_outliers else None)
    # Good steps pay for the decision only: the averaged gradients' checks
    # (a NaN/Inf of any tower survives averaging) name the variables, and
    # each tower adds one fused flag, which keeps the tower of a fault that
    # would not reproduce. One tower's gradients are the averaged ones: its
    # flag is the decision's (`_decide`).
    flag = (nonfinite.any_nonfinite([g for g, _ in grads_and_vars])
            if num_towers > 1 else None)
    return loss, grads_and_vars, flag

  outputs = towers.build_towers(config, tower_fn, skip=quarantined)
  built = sorted(probes)
  explained = _tower_gauges(gauges, built)
  left_out = None
  if (outliers is not None and not outliers.dry_run and
      params.skip_unit == "tower"):
    with tf1.device(config.variables_device()):
      left_out = outliers.judge(_tower_norms(outputs)(),
                                [devices[i] for i in built], built,
                                num_towers, *explained())
    outliers.leave_out = True
  unit = tower_unit_lib.of_towers(params, outputs, config.variables_device(),
                                  built, left_out)
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
  return Towers(outputs, grads_and_vars, statistics, update_ops,
                tower_nonfinite, tower_inputs,
                [probes.get(i) for i in range(num_towers)], devices, unit,
                built, explained)


def _tower_norms(outputs):
  """A function building each built tower's global gradient norm."""
  return tower_outliers.tower_norms([[g for g, _ in gv]
                                     for _, gv, _ in outputs])


def _tower_gauges(gauges, built):
  """A function building, once, the built towers' stacked output gradient
  norms and shared gradient norm (`tower_loss`'s gauges)."""
  made = []

  def build():
    if not made:
      pairs = [gauges[i]() for i in built]
      made.extend([tf.stack([o for o, _ in pairs]), pairs[0][1]])
    return tuple(made)
  return build


def _tower_values(built, tower_nonfinite):
  """What the criteria see of each tower (`criteria.Context.towers`)."""
  return {"loss": tf.stack([loss for loss, _, _ in built.outputs]),
          "nonfinite": tower_nonfinite,
          # Built only if a criterion reads them.
          tower_outliers.NORM: _tower_norms(built.outputs),
          tower_outliers.OUTPUT_NORM: lambda: built.gauges()[0],
          tower_outliers.SHARED_NORM: lambda: built.gauges()[1],
          tower_outliers.DEVICE: [built.devices[i] for i in built.indices],
          tower_outliers.INDEX: list(built.indices)}


def _decide(strategy, state, built, guarded, loss):
  """Applies the averaged gradients through `guarded`, as the strategy
  decides: (its `Decided`, the report's tower flags, per-variable flags
  and names)."""
  pairs = list(built.grads_and_vars) + built.statistics
  tower_nonfinite = built.nonfinite
  # For the criteria (run if one reads them); sync replicas' chief has none.
  kwargs = {}
  if not getattr(strategy, "sync", False):
    kwargs = dict(loss=loss, tower_values=_tower_values(built,
                                                        tower_nonfinite))
  with tf1.control_dependencies([state.step_index]):
    decided = strategy.decide(guarded, pairs, state.global_step,
                              tower_nonfinite, **kwargs)
  result = decided.result  # (Returned: not the wrapper's `guard_result()`.)
  average_flags, names = result.nonfinite_flags, result.variable_names
  if result.update_variable_names:
    # The checked statistics are tower 0's (as in a cluster).
    tower_nonfinite = _or_tower0(tower_nonfinite,
                                 tf.reduce_any(result.update_flags))
    average_flags = tf.concat([average_flags, result.update_flags], axis=0)
    names = names + result.update_variable_names
  if built.unit:  # Left-out towers' variables (their average has none).
    average_flags = tf.logical_or(average_flags,
                                  built.unit.nonfinite_variables(names))
  if len(built.outputs) == 1:
    tower_nonfinite = tf.reshape(tf.reduce_any(average_flags), [1])
  return decided, tower_nonfinite, average_flags, names


def build_step(params, strategy, dataset_fn=None, exclude_ids=(),
               criteria=(), quarantined=(), replays=None, skip_batches=0):
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
    criteria: more skip criteria (`criteria.Criterion`), decided with
      those `params` ask for (`criterion_registry`); they see the step's
      mean loss and, in `Context.towers`, each tower's "loss" and "nonfinite"
      flag (not with sync replicas, whose chief decides on the aggregate).
    quarantined: indices of towers not built (`quarantine`; only with
      --skip_unit=tower): no node of theirs runs, no input is read.
    replays: whether to build what a skip's replay needs (the towers'
      probes, the skip's saver: `replay_lib.Forensics`); None: if a run of
      `params` can replay (`replay_lib.can_replay`).
    skip_batches: batches of the input the towers start past (those an
      earlier segment of the process read: `segments`).

  Returns:
    A `Step`.
  """
  config = strategy.tower_config
  if replays is None:
    replays = replay_lib.can_replay(params)
  with tf1.device(config.variables_device()):
    state = step_state.StepState(config.num_towers)
    criteria = criterion_registry.from_params(params) + list(criteria)
    learning_rate, optimizer, loss_scale, scale = _optimizer(params, state)
  outliers = next((c for c in criteria
                   if isinstance(c, tower_outliers.TowerOutliers)), None)
  built = _build_towers(params, strategy, state.step_index, optimizer,
                        loss_scale, scale, dataset_fn, exclude_ids,
                        quarantined, replays, skip_batches, outliers)
  unit = built.unit
  worker_unit = strategy.decision_unit()
  # The one guarded step of the library (the public wrapper), deciding
  # where the strategy says: here, or on the chief for the aggregate.
  guarded = optimizer_lib.SkipNonFiniteOptimizer(
      applied_update.AppliedUpdate(params, optimizer, built.statistics,
                                   state.counters.applied_steps),
      increment_global_step_on_skip=params.increment_global_step_on_skip,
      update_ops=built.update_ops, loss_scale=loss_scale, name="guarded_step",
      criteria=criteria,
      # The trainer builds the whole step itself and checks it by its
      # tests: no first-run check (`run_check`), which would cost a dict
      # lookup per run and name its own counters' writes.
      check_runs=False, tower_unit=unit or worker_unit)
  with tf1.device(config.variables_device()):
    loss = unit.loss if unit else (
        tf.add_n([loss for loss, _, _ in built.outputs]) /
        float(len(built.outputs)))
    decided, tower_nonfinite, average_flags, names = _decide(
        strategy, state, built, guarded, loss)
    step_op, result = decided.step_op, decided.result
    # (A left-out tower 0's batch is no control batch: `batch_store`.)
    keep = built.inputs.keep_if_applied(
        tf.logical_and(result.applied, unit.keep_updates) if unit
        else result.applied, state.step_index)
    train_op = tf.group(step_op, keep, *state.updates(
        step_op, tower_nonfinite), name="train_op")
    totals, after = state.totals(train_op, decided.reasons)
    with tf1.control_dependencies([train_op]):
      for key, left_out in ((tower_unit_lib.REJECTED, unit),
                            (getattr(worker_unit, "REJECTED", None),
                             worker_unit)):  # Each unit's count, if on.
        if left_out:
          totals[key] = tf.identity(left_out.rejected.read_value())
      if outliers is not None and outliers.variables:
        totals[tower_outliers.BY_TOWER] = tf.identity(
            outliers.by_tower.read_value())
  step = Step(
      train_op=train_op, step_index=state.step_index, loss=loss,
      learning_rate=learning_rate, applied=result.applied, counters=after,
      report=SkipReport(tower_nonfinite, average_flags, names, built.devices),
      totals=totals,
      loss_scale=loss_scale.read_after(train_op) if loss_scale else None,
      loss_scale_before=scale, variables=state.variables,
      reasons=result.reasons,
      forensics=replay_lib.Forensics(built.inputs.store, built.probes, scale,
                                     replays=replays),
      tower_unit=unit, worker_unit=worker_unit)
  step_summaries.add(step)
  return step
