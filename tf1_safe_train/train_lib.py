"""The multi-tower trainer: towers, one guarded decision, hooks, run summary.

`build_train_graph(params, tower_config)` builds the classic TF1 multi-device
step (towers -> averaged gradients -> one reduced non-finite check -> `tf.cond`
apply/skip); `train(params)` runs it under `MonitoredTrainingSession` and
writes `<train_dir>/run_summary.json`.
"""

import collections
import json
import os
import time

from absl import logging
import tensorflow as tf

from tf1_safe_train import counters as counters_lib
from tf1_safe_train import data
from tf1_safe_train import guard
from tf1_safe_train import hooks as hooks_lib
from tf1_safe_train import injection
from tf1_safe_train import models
from tf1_safe_train import optimization
from tf1_safe_train import towers

tf1 = tf.compat.v1

RUN_SUMMARY = "run_summary.json"

TrainGraph = collections.namedtuple("TrainGraph", [
    "train_op", "step_index", "loss", "learning_rate", "applied", "counters",
    "tower_flags", "average_flags", "variable_names", "tower_devices",
    "global_step", "nonfinite_steps_by_tower", "max_consecutive_skips_seen"
])
TrainGraph.__doc__ = """Tensors of one training step (reads ordered after it)."""


def _weight_decay_loss(rate):
  weights = [v for v in tf1.trainable_variables()
             if v.op.name.endswith("weights")]
  if not rate or not weights:
    return None
  with tf1.name_scope("weight_decay"):
    return rate * tf.add_n([tf.nn.l2_loss(w) for w in weights])


def _tower_step(params, tower_index, iterator, model_fn, optimizer, rules,
                step_index, worker_index):
  """Builds tower `tower_index`: loss, gradients, non-finite flags."""
  images, labels = iterator.get_next()
  active, value = injection.active_value(
      rules, step_index, tower=tower_index, worker=worker_index,
      seed=params.seed)
  if params.inject_into == "input":
    images = injection.poison(images, active, value)
  logits = model_fn(images, is_training=True, num_classes=data.NUM_CLASSES)
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
      loss, var_list=tf1.trainable_variables(),
      colocate_gradients_with_ops=True)
  if params.inject_into == "grads":
    grads_and_vars = list(grads_and_vars)
    for i, (g, v) in enumerate(grads_and_vars):
      if g is not None:
        grads_and_vars[i] = (injection.poison(g, active, value), v)
        break
  flags = guard.nonfinite_flags([g for g, _ in grads_and_vars])
  return loss, grads_and_vars, flags


def build_train_graph(params, tower_config, worker_index=0):
  """Builds the training step in the default graph.

  Args:
    params: validated `params.TrainParams`.
    tower_config: `towers.TowerConfig`.
    worker_index: this worker's index (fault injection selects workers).

  Returns:
    A `TrainGraph`.
  """
  rules = injection.parse_spec(params.inject_nonfinite)
  injection.validate(rules, tower_config.num_towers)
  model_fn = models.get_model(params.model)
  num_towers = tower_config.num_towers

  with tf1.device(tower_config.variables_device()):
    global_step = tf1.train.get_or_create_global_step()
    counters = counters_lib.skip_counters()
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

  with tf.device("/device:CPU:0"), tf1.name_scope("input"):
    dataset = data.get_dataset(params.dataset, "train", params.batch_size,
                               data_dir=params.data_dir, seed=params.seed)
    iterator = tf1.data.make_one_shot_iterator(dataset)

  tower_outputs = towers.build_towers(
      tower_config,
      lambda i: _tower_step(params, i, iterator, model_fn, optimizer, rules,
                            step_index, worker_index))
  losses = [out[0] for out in tower_outputs]
  tower_flags = tf.stack([out[2] for out in tower_outputs])
  grads_and_vars = towers.average_gradients([out[1] for out in tower_outputs])
  # Like model_deploy: batch-norm statistics come from the first tower.
  update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS,
                                  tower_config.tower_scope(0))

  def apply_fn(checked_grads_and_vars):
    if params.clip_gradient_norm:
      checked_grads_and_vars, _ = optimization.clip_by_global_norm(
          checked_grads_and_vars, params.clip_gradient_norm)
    update = optimizer.apply_gradients(checked_grads_and_vars)
    if not params.moving_average_decay:
      return update
    ema = tf1.train.ExponentialMovingAverage(
        params.moving_average_decay, num_updates=counters.applied_steps)
    with tf1.control_dependencies([update]):
      return ema.apply(tf1.trainable_variables())

  with tf1.device(tower_config.variables_device()):
    tower_nonfinite = tf.reduce_any(tower_flags, axis=1)
    with tf1.control_dependencies([step_index]):
      result = guard.guarded_apply(
          grads_and_vars, apply_fn, global_step=global_step,
          increment_global_step_on_skip=params.increment_global_step_on_skip,
          update_ops=update_ops,
          extra_nonfinite=tf.unstack(tower_nonfinite),
          name="guarded_step")
    with tf1.control_dependencies([result.train_op]):
      stats = [
          tf1.assign_add(nonfinite_by_tower,
                         tf.cast(tower_nonfinite, tf.int64)),
          tf1.assign(max_seen, tf.maximum(
              max_seen.read_value(), result.counters.consecutive_skips)),
      ]
    train_op = tf.group(result.train_op, *stats, name="train_op")
    after = counters_lib.read_after(counters, train_op)
    with tf1.control_dependencies([train_op]):
      global_step_after = tf.identity(global_step.read_value())
      nonfinite_after = tf.identity(nonfinite_by_tower.read_value())
      max_seen_after = tf.identity(max_seen.read_value())
    loss = tf.add_n(losses) / float(num_towers)

  graph = TrainGraph(
      train_op=train_op, step_index=step_index, loss=loss,
      learning_rate=learning_rate, applied=result.applied, counters=after,
      tower_flags=tower_flags, average_flags=result.nonfinite_flags,
      variable_names=result.variable_names,
      tower_devices=[tower_config.tower_device(i) for i in range(num_towers)],
      global_step=global_step_after,
      nonfinite_steps_by_tower=nonfinite_after,
      max_consecutive_skips_seen=max_seen_after)
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
  for v in tf1.trainable_variables():
    # Weights cannot hold NaN: skipped steps never write them.
    tf1.summary.histogram("weights/" + v.op.name, v)


class TrainDirError(ValueError):
  """The train directory cannot be used; the message says why in one line."""


def check_train_dir(train_dir):
  """Creates `train_dir` if needed; raises TrainDirError if not writable."""
  try:
    os.makedirs(train_dir, exist_ok=True)
    probe = os.path.join(train_dir, ".write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise TrainDirError("--train_dir=%s is not writable: %s" %
                     (train_dir, e.strerror or e)) from None


def write_run_summary(train_dir, summary):
  """Writes `summary` to `<train_dir>/run_summary.json` atomically."""
  path = os.path.join(train_dir, RUN_SUMMARY)
  with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(path + ".tmp", path)
  return path


def train(params, tower_config=None, master="", is_chief=True,
          worker_index=0, extra_hooks=()):
  """Trains as `params` says and returns the run summary (a dict).

  Args:
    params: validated `params.TrainParams`.
    tower_config: `towers.TowerConfig`; default: from params (variables on the
      CPU).
    master: session target ('' in-process; a grpc:// address for a cluster).
    is_chief: whether this process saves checkpoints and summaries.
    worker_index: this worker's index.
    extra_hooks: more `SessionRunHook`s.

  Returns:
    The dict also written to `run_summary.json` (by the chief).
  """
  params.validate()
  if tower_config is None:
    tower_config = towers.TowerConfig(params.num_towers, params.device)
  if is_chief:
    check_train_dir(params.train_dir)
  start = time.time()
  with tf.Graph().as_default():
    tf1.set_random_seed(params.seed)
    graph = build_train_graph(params, tower_config, worker_index)
    examples_per_step = params.batch_size * tower_config.num_towers
    progress = hooks_lib.ProgressHook(
        graph.step_index, graph.loss, graph.learning_rate, graph.counters,
        examples_per_step, params.log_every_n_steps,
        summary_dir=params.train_dir if is_chief else None)
    skip_report = hooks_lib.SkipReportHook(
        graph.step_index, graph.applied, graph.tower_flags,
        graph.average_flags, graph.variable_names, graph.tower_devices)
    give_up = hooks_lib.GiveUpHook(graph.counters.consecutive_skips,
                                   params.max_consecutive_skips)
    on_signal = hooks_lib.StopOnSignalHook()
    stats = hooks_lib.RunStatsHook({
        "global_step": graph.global_step, "loss": graph.loss,
        "counters": graph.counters,
        "nonfinite_steps_by_tower": graph.nonfinite_steps_by_tower,
        "max_consecutive_skips_seen": graph.max_consecutive_skips_seen})
    run_hooks = [tf1.train.StopAtStepHook(last_step=params.max_steps),
                 progress, skip_report, give_up, on_signal, stats]
    run_hooks += list(extra_hooks)
    scaffold = tf1.train.Scaffold(saver=tf1.train.Saver(max_to_keep=5))
    on_signal.install()
    first_step_time = None
    try:
      with tf1.train.MonitoredTrainingSession(
          master=master, is_chief=is_chief, checkpoint_dir=params.train_dir,
          scaffold=scaffold, hooks=run_hooks,
          save_checkpoint_steps=params.save_checkpoints_steps,
          save_summaries_steps=params.save_summaries_steps,
          log_step_count_steps=None,
          config=towers.session_config(tower_config)) as session:
        while not session.should_stop():
          session.run(graph.train_op)
          if first_step_time is None:
            first_step_time = time.time()
    finally:
      on_signal.uninstall()
  end = time.time()
  if give_up.gave_up:
    exit_reason = "too_many_consecutive_skips"
  elif on_signal.interrupted:
    exit_reason = "interrupted"
  else:
    exit_reason = "max_steps"
  summary = _run_summary(params, stats, first_step_time, start, end,
                         examples_per_step, exit_reason)
  if is_chief:
    write_run_summary(params.train_dir, summary)
  return summary


def _run_summary(params, stats, first_step_time, start, end, examples_per_step,
                 exit_reason):
  """The run_summary.json dict (see README)."""
  latest = stats.latest
  if latest is None:  # Nothing ran: the checkpoint was already at max_steps.
    return {"exit_reason": exit_reason, "global_step": None,
            "wall_seconds": round(end - start, 3), "params": params.to_dict()}
  timed_steps = stats.steps_run - 1
  timed_seconds = end - first_step_time if first_step_time else 0.0
  counters = latest["counters"]
  return {
      "global_step": int(latest["global_step"]),
      "applied_steps": int(counters.applied_steps),
      "skipped_steps": int(counters.skipped_steps),
      "consecutive_skips": int(counters.consecutive_skips),
      "max_consecutive_skips_seen": int(latest["max_consecutive_skips_seen"]),
      "nonfinite_steps_by_tower": [
          int(c) for c in latest["nonfinite_steps_by_tower"]],
      "final_loss": float(latest["loss"]),
      "examples_per_sec": (round(timed_steps * examples_per_step /
                                 timed_seconds, 2)
                           if timed_steps > 0 and timed_seconds > 0 else None),
      "steps_this_run": stats.steps_run,
      "wall_seconds": round(end - start, 3),
      "exit_reason": exit_reason,
      "params": params.to_dict(),
  }
