"""Training and evaluation parameters: one validated, immutable object each.

The binaries' `main` modules turn their flags into these; library code and
tests build them directly (`TrainParams(model="resnet20", max_steps=3)`).
Every field has a default; `validate()` raises `ParamsError` naming the bad
value (the checks are in `param_validation`).
"""

import dataclasses

from tf1_safe_train.core import criterion_registry
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.config import param_validation

# The values a choice field takes (kept importable from here).
MODELS = param_validation.MODELS
PRECISIONS = param_validation.PRECISIONS
DATASETS = param_validation.DATASETS
DEVICES = param_validation.DEVICES
OPTIMIZERS = param_validation.OPTIMIZERS
LR_SCHEDULES = param_validation.LR_SCHEDULES
LR_STEPS = param_validation.LR_STEPS
INJECT_INTO = param_validation.INJECT_INTO
ON_PERSISTENT_SKIPS = param_validation.ON_PERSISTENT_SKIPS
SKIP_UNITS = param_validation.SKIP_UNITS
ParamsError = param_validation.ParamsError

_param = flag_specs.param


@dataclasses.dataclass(frozen=True)
class TrainParams(object):
  """Everything `train_lib.train` needs; a field declares its `//:train` flag.

  `flag_specs.of_params(TrainParams)` turns the declarations into the flags
  (train.py) and the docs' flags table (docs/flags.md). The skip criteria's
  fields (e.g. skip_spikes_sigma) are declared by their specs
  (`criterion_registry`), after these.
  """
  # The flag's '' is a fresh directory per run (train.py names it on the
  # first line): a shared default would be resumed by a forgotten flag.
  train_dir: str = _param(
      "/tmp/tf1_safe_train", "Checkpoints, summaries and run_summary.json; "
      "re-running with the same directory resumes; default: a fresh "
      "directory, named on the first line (required in a cluster).",
      flag_default="", doc_default="a fresh one per run")
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
      "applied steps before the streak, skip the batches since, go on; in a "
      "cluster with --sync_replicas only).", ON_PERSISTENT_SKIPS)
  rollback_min_applied_steps: int = _param(
      200, "Rollback: the checkpoint restored holds at most this many applied "
      "steps fewer than when the streak began.")
  max_rollbacks: int = _param(
      3, "Rollback: at most this many rollbacks per run, then stop.")
  rollback_halve_learning_rate: bool = _param(
      False, "Rollback: halve the learning rate at each rollback (kept in "
      "checkpoints).")
  skip_unit: str = _param(
      "step", "What a non-finite tower costs: step (the whole step is "
      "skipped), tower (that tower is left out and the others' average "
      "applied, see docs/trainer.md; one machine only) or worker (with "
      "--sync_replicas: that worker's push is left out, see "
      "docs/several_machines.md).", SKIP_UNITS)
  min_healthy_towers: int = _param(
      0, "--skip_unit=tower: skip the whole step when fewer towers than "
      "this are healthy; 0 = half the towers, rounded up.")
  min_healthy_workers: int = _param(
      0, "--skip_unit=worker: skip the whole step when fewer workers than "
      "this are healthy; 0 = half the workers, rounded up.")
  quarantine_after: int = _param(
      0, "--skip_unit=tower (worker): quarantine a tower (a worker) after "
      "this many faults that did not reproduce on replay (a suspect "
      "device): the rest of the run, restarts included, goes on without "
      "it; 0 = off.")
  clear_quarantine: bool = _param(
      False, "Start with no tower (worker) quarantined and the fault counts "
      "at zero.")
  save_checkpoints_steps: int = _param(
      200, "Checkpoint every this many steps (and at the end).")
  save_summaries_steps: int = _param(
      100, "TensorBoard summaries every this many steps; the skips/ "
      "counters are written regardless, on every step that changes one and "
      "at the run's last step.")
  log_every_n_steps: int = _param(50, "Progress line every this many steps.")
  inject_nonfinite: str = _param(
      "", "Fault drill: comma-separated KIND@STEPS[:TOWER][/WORKER] or "
      "KIND%PROB[:TOWER][/WORKER] (KIND nan|inf|-inf, scaleF to multiply "
      "by F, e.g. scale1e4: a finite spike; on grads also bitflipK, bit K "
      "of the largest element of the first gradient, and stale, the "
      "previous step's gradients; STEPS N, N-M or N-, a range optionally "
      "~S: every S-th step; TOWER and WORKER default to 0), e.g. "
      "nan@100:1,inf%0.01,bitflip30@200-~50:2.")
  inject_into: str = _param(
      "grads", "What the drill poisons: a tower's grads, loss or input "
      "images.", INJECT_INTO)
  seed: int = _param(0, "Graph-level random seed.")
  max_explained_skips: int = _param(
      10, "Replay at most this many skipped steps per run (each names the "
      "first non-finite op and data or device, see docs/forensics.md); "
      "0 = none (skips are still recorded in skips.jsonl). skips/ keeps "
      "the saved states of the newest this many, across runs.")
  exclude_reproducible_skips: bool = _param(
      True, "At startup, drop from the input the examples of skips whose "
      "replay reproduced (skips.jsonl) and of the data windows rollbacks "
      "abandoned (rollback_windows.jsonl).")
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
  loss_scale_hysteresis: int = _param(
      1, "fp16: halve the loss scale only on the Nth overflowing (skipped) "
      "step in a row and each one after it (an applied step ends the "
      "streak); 1 = every overflow halves it.")
  # In a cluster; ignored on one machine.
  startup_timeout_secs: float = _param(
      600.0, "Cluster: how long a worker waits for the parameter servers "
      "(and for the chief to initialise the model), at start-up and for a ps "
      "lost mid-run.")

  def validate(self):
    """Returns self if every field is valid; raises ParamsError otherwise."""
    param_validation.check_train(self)
    return self

  def replace(self, **changes):
    """Returns a validated copy with `changes` applied."""
    return dataclasses.replace(self, **changes).validate()

  def to_dict(self):
    return dataclasses.asdict(self)


def _redeclare(add=(), remove=()):
  """`TrainParams` with the fields of the flags `add` and without those of
  `remove` (`criterion_spec.Flag`s). The class stays the same object:
  instances made before keep working, with the defaults."""
  cls = TrainParams
  for field in dataclasses.fields(cls):  # Re-declared as they are.
    setattr(cls, field.name, field)
  for flag in remove:
    del cls.__annotations__[flag.name]
    delattr(cls, flag.name)
  for flag in add:
    cls.__annotations__[flag.name] = type(flag.default)
    setattr(cls, flag.name, _param(flag.default, flag.help))
  # What `dataclass` made of the fields, made again.
  for name in ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__",
               "__delattr__", "__match_args__"):
    if name in cls.__dict__:
      delattr(cls, name)
  dataclasses.dataclass(frozen=True)(cls)


def _declare_criterion(spec):
  taken = {f.name for f in dataclasses.fields(TrainParams)}
  if taken & {flag.name for flag in spec.flags}:
    raise ValueError("criterion %r: a flag of its is a TrainParams field" %
                     spec.reason)
  _redeclare(add=spec.flags)


criterion_registry.on_register(
    _declare_criterion, lambda spec: _redeclare(remove=spec.flags))


@dataclasses.dataclass(frozen=True)
class EvalParams(object):
  """Everything `eval_lib.evaluate` needs; fields declare `//:eval`'s flags."""
  train_dir: str = _param(
      "/tmp/tf1_safe_train",
      "The training run's directory (its latest checkpoint); required.",
      flag_default="", doc_default="")
  # eval.py takes these three from the run's run_summary.json when the flag
  # is not given (`recorded_params`).
  model: str = _param(
      "small_cnn", "The model the run trained; default: the run's "
      "(run_summary.json), else small_cnn.", MODELS)
  dataset: str = _param(
      "synthetic", "The dataset whose test split is evaluated; default: the "
      "run's, else synthetic.", DATASETS)
  data_dir: str = _param("", "Folder of test_batch.bin for cifar10; "
                         "default: the run's --data_dir.")
  batch_size: int = _param(100, "Evaluation batch.")
  max_examples: int = _param(
      0, "Evaluate at most this many examples; 0 = all.")

  def validate(self):
    """Returns self if every field is valid; raises ParamsError otherwise."""
    param_validation.check_eval(self)
    return self
