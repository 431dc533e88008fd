"""Training and evaluation parameters: one validated, immutable object each.

The binaries' `main` modules turn their flags into these; library code and
tests build them directly (`TrainParams(model="resnet20", max_steps=3)`).
Every field has a default; `validate()` raises `ParamsError` naming the bad
value.
"""

import dataclasses
import math

from tf1_safe_train.core import checks
from tf1_safe_train.trainer import flag_specs

MODELS = ("small_cnn", "resnet20")
PRECISIONS = ("fp32", "fp16", "bf16")
DATASETS = ("synthetic", "cifar10")
DEVICES = ("gpu", "cpu")
OPTIMIZERS = ("momentum", "sgd", "adam", "rmsprop")
LR_SCHEDULES = ("constant", "piecewise", "cosine")
LR_STEPS = ("applied_steps", "global_step")
INJECT_INTO = ("grads", "loss", "input")
ON_PERSISTENT_SKIPS = ("stop", "rollback")

_param = flag_specs.param


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
def _check_spikes(params):
  _check(checks.is_number(params.skip_spikes_sigma) and
         params.skip_spikes_sigma >= 0,
         "--skip_spikes_sigma=%r: must be >= 0 (0 = off)",
         params.skip_spikes_sigma)
  for name in ("spike_warmup_steps", "spike_max_streak"):
    value = getattr(params, name)
    _check(checks.is_int(value) and value >= 1,
           "--%s=%r: must be an integer >= 1", name, value)
  _check(isinstance(params.skip_loss_spikes, bool),
         "--skip_loss_spikes=%r: must be a boolean", params.skip_loss_spikes)
  _check(not (params.skip_spikes_sigma and params.max_consecutive_skips) or
         params.spike_max_streak < params.max_consecutive_skips,
         "--spike_max_streak=%r: must be below --max_consecutive_skips=%r "
         "(the run would give up before the spike detector re-warms)",
         params.spike_max_streak, params.max_consecutive_skips)
  _check(not params.skip_loss_spikes or params.skip_spikes_sigma > 0,
         "--skip_loss_spikes needs --skip_spikes_sigma > 0")
  # The chief decides on the aggregate gradients; no loss reaches it.
  _check(not (params.skip_loss_spikes and params.sync_replicas),
         "--skip_loss_spikes is not supported with --sync_replicas (the "
         "chief decides on the aggregate gradients and sees no loss)")


@dataclasses.dataclass(frozen=True)
class TrainParams(object):
  """Everything `train_lib.train` needs; a field declares its `//:train` flag.

  `flag_specs.of_params(TrainParams)` turns the declarations into the flags
  (train.py) and the docs' flags table (docs/flags.md).
  """
  train_dir: str = _param(
      "/tmp/tf1_safe_train", "Checkpoints, summaries and run_summary.json; "
      "re-running with the same directory resumes.")
  model: str = _param("small_cnn", "The model.", MODELS)
  dataset: str = _param(
      "synthetic", "synthetic (embedded, learnable) or cifar10 (binary files "
      "in --data_dir).", DATASETS)
  data_dir: str = _param("", "Folder of the CIFAR-10 .bin files.")
  # Machine-dependent: train.py resolves the flags' None and 'auto' from the
  # GPUs TensorFlow sees; the help says how.
  num_towers: int = _param(
      2, "Towers (model replicas); default: every visible GPU, or 2 with "
      "none.", flag_default=None, doc_default="every GPU, or 2")
  device: str = _param(
      "cpu", "Where towers run: gpu (/gpu:i), cpu (virtual CPU device i) or "
      "auto (gpu if any is visible).", DEVICES, flag_default="auto",
      flag_choices=("auto",) + DEVICES)
  batch_size: int = _param(32, "Examples per tower per step.")
  optimizer: str = _param("momentum", "The optimizer (momentum is 0.9).",
                          OPTIMIZERS)
  learning_rate: float = _param(0.01, "Initial learning rate.")
  lr_schedule: str = _param(
      "constant", "constant, piecewise (x0.1 at 50% and 75% of --max_steps) "
      "or cosine.", LR_SCHEDULES)
  lr_schedule_step: str = _param(
      "applied_steps", "The counter the schedule follows: applied_steps "
      "(skipped steps do not decay the rate) or global_step.", LR_STEPS)
  weight_decay: float = _param(
      1e-4, "L2 weight decay on the weights (not biases or BN).")
  clip_gradient_norm: float = _param(
      0.0, "Clip gradients to this global norm after the finite check; "
      "0 = off.")
  moving_average_decay: float = _param(
      0.0, "EMA of the weights (updated only on applied steps); 0 = off.")
  increment_global_step_on_skip: bool = _param(
      True, "Advance global_step on skipped steps too (it counts batches, so "
      "--max_steps ends the run).")
  max_steps: int = _param(1000, "Stop when global_step reaches this.")
  max_consecutive_skips: int = _param(
      50, "Give up (exit 1) after this many skipped steps in a row; "
      "0 = never.")
  on_persistent_skips: str = _param(
      "stop", "What --max_consecutive_skips skips in a row do: stop (exit 1) "
      "or rollback (restore the newest checkpoint --rollback_min_applied_steps "
      "applied steps before the streak, skip the batches since, go on; one "
      "machine only).", ON_PERSISTENT_SKIPS)
  rollback_min_applied_steps: int = _param(
      200, "Rollback: the checkpoint restored holds at most this many applied "
      "steps fewer than when the streak began.")
  max_rollbacks: int = _param(
      3, "Rollback: at most this many rollbacks per run, then stop.")
  rollback_halve_learning_rate: bool = _param(
      False, "Rollback: halve the learning rate at each rollback (kept in "
      "checkpoints).")
  skip_spikes_sigma: float = _param(
      0.0, "Also skip a finite step whose global gradient norm exceeds its "
      "running mean over applied steps by more than this many standard "
      "deviations (log scale), e.g. 6; 0 = off.")
  spike_warmup_steps: int = _param(
      100, "--skip_spikes_sigma: applied steps of history before a step can "
      "be a spike.")
  spike_max_streak: int = _param(
      10, "--skip_spikes_sigma: this many spike skips in a row are a regime "
      "change, not a spike: the detector re-warms.")
  skip_loss_spikes: bool = _param(
      False, "--skip_spikes_sigma: also skip a step whose loss is a spike "
      "(not with --sync_replicas: the chief sees no loss).")
  save_checkpoints_steps: int = _param(
      200, "Checkpoint every this many steps (and at the end).")
  save_summaries_steps: int = _param(
      100, "TensorBoard summaries every this many steps.")
  log_every_n_steps: int = _param(50, "Progress line every this many steps.")
  inject_nonfinite: str = _param(
      "", "Fault drill: comma-separated KIND@STEPS[:TOWER][/WORKER] or "
      "KIND%PROB[:TOWER][/WORKER] (KIND nan|inf|-inf, or scaleF to multiply "
      "by F, e.g. scale1e4: a finite spike; STEPS N, N-M or N-; "
      "TOWER and WORKER default to 0), e.g. nan@100:1,inf%0.01,nan@10-20:0/1.")
  inject_into: str = _param(
      "grads", "What the drill poisons: a tower's grads, loss or input "
      "images.", INJECT_INTO)
  seed: int = _param(0, "Graph-level random seed.")
  max_explained_skips: int = _param(
      10, "Replay at most this many skipped steps per run (each names the "
      "first non-finite op and data or device, see docs/forensics.md); "
      "0 = none (skips are still recorded in skips.jsonl).")
  exclude_reproducible_skips: bool = _param(
      True, "At startup, drop the examples of skips whose replay reproduced "
      "(read from skips.jsonl) from the input.")
  # In a cluster (see cluster/spec.py); ignored on one machine.
  sync_replicas: bool = _param(
      False, "Cluster: aggregate every worker's gradients and decide "
      "apply/skip on the aggregate (one poisoned replica skips the step for "
      "all); false: each worker's step is applied or skipped on its own.")
  precision: str = _param(
      "fp32", "Compute precision (float32 master weights): fp32, fp16 (with "
      "dynamic loss scaling) or bf16.", PRECISIONS)
  initial_loss_scale: float = _param(2.0**15,
                                     "fp16: the starting loss scale.")
  loss_scale_growth_steps: int = _param(
      2000, "fp16: double the loss scale after this many applied steps in a "
      "row (a skip halves it, floor 1).")
  # In a cluster; ignored on one machine.
  startup_timeout_secs: float = _param(
      600.0, "Cluster: how long a worker waits for the parameter servers "
      "(and for the chief to initialise the model), at start-up and for a ps "
      "lost mid-run.")

  def validate(self):
    """Returns self if every field is valid; raises ParamsError otherwise."""
    _check_model_and_data(self, "data_batch_*.bin")
    _check_finite_floats(self)
    _check(checks.is_int(self.num_towers) and self.num_towers >= 1,
           "--num_towers=%r: must be an integer >= 1", self.num_towers)
    _check_one_of("device", self.device, DEVICES)
    _check(checks.is_int(self.batch_size) and self.batch_size >= 1,
           "--batch_size=%r: must be an integer >= 1 (per tower)",
           self.batch_size)
    _check_one_of("optimizer", self.optimizer, OPTIMIZERS)
    _check(self.learning_rate > 0, "--learning_rate=%r: must be > 0",
           self.learning_rate)
    _check_one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
    _check_one_of("lr_schedule_step", self.lr_schedule_step, LR_STEPS)
    _check(self.weight_decay >= 0, "--weight_decay=%r: must be >= 0",
           self.weight_decay)
    _check(self.clip_gradient_norm >= 0,
           "--clip_gradient_norm=%r: must be >= 0 (0 = off)",
           self.clip_gradient_norm)
    _check(0 <= self.moving_average_decay < 1,
           "--moving_average_decay=%r: must be in [0, 1) (0 = off)",
           self.moving_average_decay)
    _check(checks.is_int(self.max_steps) and self.max_steps >= 1,
           "--max_steps=%r: must be an integer >= 1", self.max_steps)
    _check(checks.is_int(self.max_consecutive_skips) and
           self.max_consecutive_skips >= 0,
           "--max_consecutive_skips=%r: must be an integer >= 0 (0 = never "
           "give up)", self.max_consecutive_skips)
    _check_rollback(self)
    _check_spikes(self)
    for name in ("save_checkpoints_steps", "save_summaries_steps",
                 "log_every_n_steps"):
      value = getattr(self, name)
      _check(checks.is_int(value) and value >= 1,
             "--%s=%r: must be an integer >= 1", name, value)
    _check_one_of("inject_into", self.inject_into, INJECT_INTO)
    _check(checks.is_int(self.seed), "--seed=%r: must be an integer", self.seed)
    _check(checks.is_int(self.max_explained_skips) and
           self.max_explained_skips >= 0,
           "--max_explained_skips=%r: must be an integer >= 0",
           self.max_explained_skips)
    _check_one_of("precision", self.precision, PRECISIONS)
    _check(1 <= self.initial_loss_scale <= 2.0**127,
           "--initial_loss_scale=%r: must be >= 1 and <= 2**127 (float32)",
           self.initial_loss_scale)
    _check(checks.is_int(self.loss_scale_growth_steps) and
           self.loss_scale_growth_steps >= 1,
           "--loss_scale_growth_steps=%r: must be an integer >= 1",
           self.loss_scale_growth_steps)
    _check(isinstance(self.sync_replicas, bool),
           "--sync_replicas=%r: must be a boolean", self.sync_replicas)
    # The sync token that releases the replicas carries global_step; a skip
    # that did not advance it would leave every replica's gradients stale.
    _check(not self.sync_replicas or self.increment_global_step_on_skip,
           "--sync_replicas needs --increment_global_step_on_skip (the "
           "replicas' sync tokens carry global_step)")
    _check(checks.is_number(self.startup_timeout_secs) and
           self.startup_timeout_secs > 0,
           "--startup_timeout_secs=%r: must be > 0", self.startup_timeout_secs)
    return self

  def replace(self, **changes):
    """Returns a validated copy with `changes` applied."""
    return dataclasses.replace(self, **changes).validate()

  def to_dict(self):
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EvalParams(object):
  """Everything `eval_lib.evaluate` needs; fields declare `//:eval`'s flags."""
  train_dir: str = _param(
      "/tmp/tf1_safe_train",
      "The training run's directory (its latest checkpoint).")
  model: str = _param("small_cnn", "The model the run trained.", MODELS)
  dataset: str = _param(
      "synthetic", "The dataset whose test split is evaluated.", DATASETS)
  data_dir: str = _param("", "Folder of test_batch.bin for cifar10.")
  batch_size: int = _param(100, "Evaluation batch.")
  max_examples: int = _param(
      0, "Evaluate at most this many examples; 0 = all.")

  def validate(self):
    """Returns self if every field is valid; raises ParamsError otherwise."""
    _check_model_and_data(self, "test_batch.bin")
    _check(checks.is_int(self.batch_size) and self.batch_size >= 1,
           "--batch_size=%r: must be an integer >= 1", self.batch_size)
    _check(checks.is_int(self.max_examples) and self.max_examples >= 0,
           "--max_examples=%r: must be an integer >= 0 (0 = all)",
           self.max_examples)
    return self
