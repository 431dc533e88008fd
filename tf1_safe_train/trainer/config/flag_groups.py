"""`//:train`'s flags by concept, for its --help, and the names it answers.

`groups()` orders the flags by what a user is doing, the common ones first
(absl's --help is one alphabetical list), each skip criterion's in a group
of its own (`criterion_registry`); every flag of `//:train` is in exactly
one group (tests/e2e/cli_test.py). `FOREIGN` maps the common flags of
tf_cnn_benchmarks, the TF1 multi-GPU benchmark most users come from, to
ours: `//:train` answers such a flag with one line naming ours (exit 2)
rather than take it as an alias, because none means exactly the same
(--num_batches counts this run's batches, --max_steps the global step, a
resume's earlier steps included; --num_gpus also chose the device): a
silent alias would be silently different. This module imports neither absl
nor TensorFlow.
"""

import textwrap

from tf1_safe_train.core import criterion_registry

_GROUPS = (
    ("The run", ("train_dir", "model", "max_steps", "batch_size",
                 "num_towers", "device", "dataset", "data_dir")),
    ("Optimization", ("optimizer", "learning_rate", "lr_schedule",
                      "lr_schedule_step", "weight_decay",
                      "clip_gradient_norm", "moving_average_decay", "seed")),
    ("Precision", ("precision", "initial_loss_scale",
                   "loss_scale_growth_steps", "loss_scale_hysteresis")),
    ("Skipped steps: counting, giving up, rolling back", (
        "increment_global_step_on_skip", "max_consecutive_skips",
        "on_persistent_skips", "rollback_min_applied_steps", "max_rollbacks",
        "rollback_halve_learning_rate")),
    ("Why a step was skipped (forensics)", ("max_explained_skips",
                                            "exclude_reproducible_skips")),
    None,  # The skip criteria's groups.
    ("A tower left out instead of the step", (
        "skip_unit", "min_healthy_towers", "min_healthy_workers",
        "quarantine_after", "clear_quarantine")),
    ("Fault drill", ("inject_nonfinite", "inject_into")),
    ("Checkpoints, summaries, progress lines", (
        "save_checkpoints_steps", "save_summaries_steps",
        "log_every_n_steps")),
    ("Several machines", ("sync_replicas", "startup_timeout_secs",
                          "ps_hosts", "worker_hosts", "job_name",
                          "task_index")),
)



def groups():
  """((title, flag names), ...): every flag of `//:train` in one group."""
  criteria = tuple((spec.group, tuple(flag.name for flag in spec.flags))
                   for spec in criterion_registry.specs())
  return tuple(g for group in _GROUPS
               for g in ((group,) if group else criteria))


# tf_cnn_benchmarks' flag -> what to use here (one line each).
FOREIGN = {
    "num_gpus": "--num_towers (with --device=gpu; towers default to every "
                "visible GPU)",
    "num_batches": "--max_steps (the global step to stop at: a resumed run "
                   "counts its earlier steps)",
    "num_epochs": "--max_steps (steps, not epochs)",
    "use_fp16": "--precision=fp16 (with dynamic loss scaling)",
    "fp16_loss_scale": "--initial_loss_scale (with --precision=fp16)",
    "fp16_enable_auto_loss_scale": "--precision=fp16 (its loss scale is "
                                   "always dynamic)",
    "data_name": "--dataset",
    "init_learning_rate": "--learning_rate",
    "piecewise_learning_rate_schedule": "--lr_schedule=piecewise (x0.1 at "
                                        "50% and 75% of --max_steps)",
    "gradient_clip": "--clip_gradient_norm",
    "display_every": "--log_every_n_steps",
    "save_model_steps": "--save_checkpoints_steps",
    "variable_update": "--sync_replicas in a cluster (docs/several_machines."
                       "md); on one machine the towers' gradients are always "
                       "averaged",
    "momentum": "--optimizer=momentum (its momentum is 0.9)",
    "num_intra_threads": "nothing: TensorFlow's defaults are used",
    "num_inter_threads": "nothing: TensorFlow's defaults are used",
}


def foreign_flag(argv):
  """(flag as typed, our flag) for the first tf_cnn_benchmarks flag of
  `argv` (before a `--`), or None."""
  for arg in argv[1:]:
    if arg == "--":
      break
    if not arg.startswith("-"):
      continue
    name = arg.lstrip("-").split("=", 1)[0]
    if name in FOREIGN:
      return arg.split("=", 1)[0], FOREIGN[name]
  return None


_WIDTH = 80


def _wrapped(text, indent):
  return textwrap.fill(" ".join(text.split()), _WIDTH,
                       initial_indent=indent, subsequent_indent=indent + "  ")


def _one_flag(spec):
  """A flag's lines of --help, in absl's layout."""
  name = ("--[no]%s" % spec.name if spec.kind == "boolean" else
          "--" + spec.name)
  text = spec.help
  if spec.kind == "enum":
    text = "<%s>: %s" % ("|".join(spec.choices), text)
  if spec.doc_default is not None:
    default = spec.doc_default or "none"
  elif isinstance(spec.default, bool):
    default = str(spec.default).lower()
  else:
    default = "'%s'" % (spec.default,) if spec.default is not None else "none"
  return [_wrapped("%s: %s" % (name, text), "  "),
          "    (default: %s)" % default]


def help_text(specs):
  """`//:train`'s --help flags: `specs` (its `FlagSpec`s) in `groups()`."""
  by_name = {spec.name: spec for spec in specs}
  lines = []
  for title, names in groups():
    lines += ["", title + ":"]
    for name in names:
      lines += _one_flag(by_name[name])
  lines += ["", _wrapped(
      "absl's own flags: -v/--verbosity (-v 0: TensorFlow's INFO lines "
      "too; -v -1: warnings only), --flagfile=FILE (flags read from FILE, "
      "one a line); --helpfull lists every flag, absl's included.", "")]
  return "\n".join(lines) + "\n"
