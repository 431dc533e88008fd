"""What a valid `TrainParams` / `EvalParams` is: the checks `validate()` runs.

Each check raises `ParamsError` with one line naming the flag and its bad
value; the choice fields' allowed values are declared here too, and the
fields themselves in `params`.
"""

import dataclasses
import math

from tf1_safe_train.core import checks
from tf1_safe_train.core import criterion_registry
from tf1_safe_train.core import criterion_spec

MODELS = ("small_cnn", "resnet20", "resnet8")
PRECISIONS = ("fp32", "fp16", "bf16")
DATASETS = ("synthetic", "cifar10")
DEVICES = ("gpu", "cpu")
OPTIMIZERS = ("momentum", "sgd", "adam", "rmsprop")
LR_SCHEDULES = ("constant", "piecewise", "cosine")
LR_STEPS = ("applied_steps", "global_step")
INJECT_INTO = ("grads", "loss", "input")
ON_PERSISTENT_SKIPS = ("stop", "rollback")
SKIP_UNITS = ("step", "tower", "worker")


class ParamsError(ValueError):
  """A parameter has a bad value; the message names it in one line."""


def _check(condition, message, *args):
  if not condition:
    raise ParamsError(message % args)


def _check_finite_floats(params):
  """Every float field must be a finite number (NaN and +-Inf pass `> 0`).

  An infinite learning rate, say, makes the first applied step write Inf and
  NaN into the weights: the guard cannot skip that step (its gradients are
  finite), so such values are refused here, before anything runs.
  """
  for field in dataclasses.fields(params):
    value = getattr(params, field.name)
    if field.type in (float, "float") and checks.is_number(value):
      _check(math.isfinite(value), "--%s=%r: must be a finite number",
             field.name, value)


def _check_one_of(name, value, choices):
  _check(value in choices, "--%s=%r: must be one of %s", name, value,
         ", ".join(choices))


def _check_model_and_data(params, data_files):
  """Checks the fields training and evaluation share: where and what."""
  _check(bool(params.train_dir), "--train_dir must not be empty")
  _check_one_of("model", params.model, MODELS)
  _check_one_of("dataset", params.dataset, DATASETS)
  _check(params.dataset != "cifar10" or bool(params.data_dir),
         "--dataset=cifar10 needs --data_dir (the folder of %s)", data_files)


def _check_rollback(params):
  _check_one_of("on_persistent_skips", params.on_persistent_skips,
                ON_PERSISTENT_SKIPS)
  _check(checks.is_int(params.rollback_min_applied_steps) and
         params.rollback_min_applied_steps >= 0,
         "--rollback_min_applied_steps=%r: must be an integer >= 0",
         params.rollback_min_applied_steps)
  _check(checks.is_int(params.max_rollbacks) and params.max_rollbacks >= 1,
         "--max_rollbacks=%r: must be an integer >= 1", params.max_rollbacks)
  _check(isinstance(params.rollback_halve_learning_rate, bool),
         "--rollback_halve_learning_rate=%r: must be a boolean",
         params.rollback_halve_learning_rate)
  # A rollback is what a streak of --max_consecutive_skips triggers.
  _check(params.on_persistent_skips != "rollback" or
         params.max_consecutive_skips != 0,
         "--on_persistent_skips=rollback needs --max_consecutive_skips >= 1 "
         "(0 never ends a streak)")


def _check_criteria(params):
  """The skip criteria's flags, checked by their specs (no TensorFlow)."""
  try:
    criterion_registry.check(params)
  except criterion_spec.SpecError as e:
    raise ParamsError(str(e)) from None


def _check_skip_unit(params):
  _check_one_of("skip_unit", params.skip_unit, SKIP_UNITS)
  _check(checks.is_int(params.min_healthy_towers) and
         0 <= params.min_healthy_towers <= params.num_towers,
         "--min_healthy_towers=%r: must be an integer in [0, --num_towers=%d] "
         "(0 = half the towers, rounded up)", params.min_healthy_towers,
         params.num_towers)
  _check(checks.is_int(params.min_healthy_workers) and
         params.min_healthy_workers >= 0,
         "--min_healthy_workers=%r: must be an integer >= 0 (0 = half the "
         "workers, rounded up)", params.min_healthy_workers)
  _check(checks.is_int(params.quarantine_after) and
         params.quarantine_after >= 0,
         "--quarantine_after=%r: must be an integer >= 0 (0 = off)",
         params.quarantine_after)
  _check(not params.quarantine_after or params.skip_unit in ("tower",
                                                              "worker"),
         "--quarantine_after needs --skip_unit=tower or worker (a "
         "quarantined tower or worker is left out of every step)")
  _check(isinstance(params.clear_quarantine, bool),
         "--clear_quarantine=%r: must be a boolean", params.clear_quarantine)


def check_train(params):
  """Checks every field of a `TrainParams`; raises ParamsError naming one.

  In the flags' order of concepts, the first bad field named (the order is
  the error a user sees first when several are wrong).
  """
  _check_model_and_data(params, "data_batch_*.bin")
  _check_finite_floats(params)
  _check_towers_and_batch(params)
  _check_optimization(params)
  _check_steps(params)
  _check_rollback(params)
  _check_criteria(params)
  _check_skip_unit(params)
  _check_periods(params)
  _check_drills_and_replays(params)
  _check_precision(params)
  _check_replicas(params)


def _check_towers_and_batch(params):
  _check(checks.is_int(params.num_towers) and params.num_towers >= 1,
         "--num_towers=%r: must be an integer >= 1", params.num_towers)
  _check_one_of("device", params.device, DEVICES)
  _check(checks.is_int(params.batch_size) and params.batch_size >= 1,
         "--batch_size=%r: must be an integer >= 1 (per tower)",
         params.batch_size)


def _check_optimization(params):
  """The optimizer, its learning rate and schedule, decay and clipping."""
  _check_one_of("optimizer", params.optimizer, OPTIMIZERS)
  _check(params.learning_rate > 0, "--learning_rate=%r: must be > 0",
         params.learning_rate)
  _check_one_of("lr_schedule", params.lr_schedule, LR_SCHEDULES)
  _check_one_of("lr_schedule_step", params.lr_schedule_step, LR_STEPS)
  _check(params.weight_decay >= 0, "--weight_decay=%r: must be >= 0",
         params.weight_decay)
  _check(params.clip_gradient_norm >= 0,
         "--clip_gradient_norm=%r: must be >= 0 (0 = off)",
         params.clip_gradient_norm)
  _check(0 <= params.moving_average_decay < 1,
         "--moving_average_decay=%r: must be in [0, 1) (0 = off)",
         params.moving_average_decay)


def _check_steps(params):
  """How long the run goes on: its steps, the skips it takes in a row."""
  _check(checks.is_int(params.max_steps) and params.max_steps >= 1,
         "--max_steps=%r: must be an integer >= 1", params.max_steps)
  _check(checks.is_int(params.max_consecutive_skips) and
         params.max_consecutive_skips >= 0,
         "--max_consecutive_skips=%r: must be an integer >= 0 (0 = never "
         "give up)", params.max_consecutive_skips)


def _check_periods(params):
  """How often the run saves, writes summaries and logs progress."""
  for name in ("save_checkpoints_steps", "save_summaries_steps",
               "log_every_n_steps"):
    value = getattr(params, name)
    _check(checks.is_int(value) and value >= 1,
           "--%s=%r: must be an integer >= 1", name, value)


def _check_drills_and_replays(params):
  """The drills (and the seed that makes a run repeat them) and how many
  skips a run replays."""
  _check_one_of("inject_into", params.inject_into, INJECT_INTO)
  _check(checks.is_int(params.seed), "--seed=%r: must be an integer",
         params.seed)
  _check(checks.is_int(params.max_explained_skips) and
         params.max_explained_skips >= 0,
         "--max_explained_skips=%r: must be an integer >= 0",
         params.max_explained_skips)


def _check_precision(params):
  """The compute precision and fp16's dynamic loss scale."""
  _check_one_of("precision", params.precision, PRECISIONS)
  _check(1 <= params.initial_loss_scale <= 2.0**127,
         "--initial_loss_scale=%r: must be >= 1 and <= 2**127 (float32)",
         params.initial_loss_scale)
  _check(checks.is_int(params.loss_scale_growth_steps) and
         params.loss_scale_growth_steps >= 1,
         "--loss_scale_growth_steps=%r: must be an integer >= 1",
         params.loss_scale_growth_steps)
  _check(checks.is_int(params.loss_scale_hysteresis) and
         params.loss_scale_hysteresis >= 1,
         "--loss_scale_hysteresis=%r: must be an integer >= 1 (1 = every "
         "overflow halves the scale)", params.loss_scale_hysteresis)


def _check_replicas(params):
  """Replicas of a cluster: synchronous or not, how long they wait."""
  _check(isinstance(params.sync_replicas, bool),
         "--sync_replicas=%r: must be a boolean", params.sync_replicas)
  # The sync token that releases the replicas carries global_step; a skip
  # that did not advance it would leave every replica's gradients stale.
  _check(not params.sync_replicas or params.increment_global_step_on_skip,
         "--sync_replicas needs --increment_global_step_on_skip (the "
         "replicas' sync tokens carry global_step)")
  # Only a sync chief sees every worker's contribution in one decision.
  _check(params.skip_unit != "worker" or params.sync_replicas,
         "--skip_unit=worker needs --sync_replicas (the chief's one "
         "decision leaves out the unhealthy workers' pushes)")
  _check(checks.is_number(params.startup_timeout_secs) and
         params.startup_timeout_secs > 0,
         "--startup_timeout_secs=%r: must be > 0", params.startup_timeout_secs)


def check_eval(params):
  """Checks every field of an `EvalParams`; raises ParamsError naming one."""
  _check_model_and_data(params, "test_batch.bin")
  _check(checks.is_int(params.batch_size) and params.batch_size >= 1,
         "--batch_size=%r: must be an integer >= 1", params.batch_size)
  _check(checks.is_int(params.max_examples) and params.max_examples >= 0,
         "--max_examples=%r: must be an integer >= 0 (0 = all)",
         params.max_examples)
