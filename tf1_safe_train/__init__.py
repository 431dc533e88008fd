"""tf1_safe_train: TF1 graph-mode training that skips non-finite steps.

Subpackages (docs/layout.md): `core` is the library a legacy script imports
(it imports nothing of the others), `trainer` the step and the runner of
//:train, `cluster` its replication; `data` and `models` the trainer's inputs.

The public names are loaded on first use, so that `import tf1_safe_train.cli`
(what the binaries do before parsing flags) does not start TensorFlow.
"""

import importlib
import importlib.util

_EXPORTS = {
    "Criterion": "tf1_safe_train.core.criteria",
    "GiveUpHook": "tf1_safe_train.core.hooks",
    "SkipCounters": "tf1_safe_train.core.counters",
    "skip_counters": "tf1_safe_train.core.counters",
    "SkipNonFiniteOptimizer": "tf1_safe_train.core.optimizer",
    "SpikeConfig": "tf1_safe_train.core.spikes",
    "sync_shadows": "tf1_safe_train.core.shadows",
    # Not the skip: tf-slim 1.1.0 made usable on TF 2.21, opt-in.
    "patch_tf_slim": "tf1_safe_train.core.tf_slim_compat",
}
# Modules a legacy script uses by name: tf1_safe_train.summaries.histogram.
_MODULES = {"summaries": "tf1_safe_train.core.summaries"}

# Where the modules of the flat package went, so that code written before
# the subpackages (`from tf1_safe_train import loss_scale`,
# `tf1_safe_train.optimizer.SkipNonFiniteOptimizer`) keeps working. Not
# `import tf1_safe_train.guard`: that form needs the new path. (The old
# `tf1_safe_train.cluster` module is now `tf1_safe_train.cluster.spec`, and
# the trainer's hooks moved out of `hooks` to
# `tf1_safe_train.trainer.run.hooks`.)
_MOVED = dict(
    [(name, "tf1_safe_train.core." + name) for name in (
        "checks", "cond_walk", "counters", "fetch_gate", "guard", "hooks",
        "loss_scale", "optimizer", "per_device", "rollback", "spikes",
        "step_report", "write_check", "writes")] +
    # The trainer's, each by its full path (tools/move_modules.py rewrites
    # these when a module moves within the trainer).
    [
        ("checkpoints", "tf1_safe_train.trainer.checkpoint.checkpoints"),
        ("crash_report", "tf1_safe_train.trainer.run.crash_report"),
        ("drill", "tf1_safe_train.trainer.drills.drill"),
        ("eval_lib", "tf1_safe_train.trainer.run.eval_lib"),
        ("finite_state", "tf1_safe_train.trainer.checkpoint.finite_state"),
        ("flag_specs", "tf1_safe_train.trainer.config.flag_specs"),
        ("injection", "tf1_safe_train.trainer.drills.injection"),
        ("optimization", "tf1_safe_train.trainer.step.optimization"),
        ("params", "tf1_safe_train.trainer.config.params"),
        ("precision", "tf1_safe_train.trainer.step.precision"),
        ("run_summary", "tf1_safe_train.trainer.run.run_summary"),
        ("step_summaries", "tf1_safe_train.trainer.step.step_summaries"),
        ("stop_signals", "tf1_safe_train.trainer.run.stop_signals"),
        ("towers", "tf1_safe_train.trainer.tower.towers"),
        ("train_dir", "tf1_safe_train.trainer.run.train_dir"),
        ("train_lib", "tf1_safe_train.trainer.run.train_lib"),
        ("train_step", "tf1_safe_train.trainer.step.train_step"),
    ] +
    [(name, "tf1_safe_train.cluster." + name) for name in (
        "cluster_flags", "local_cluster_lib", "private_network", "ps_watch",
        "replicas", "replication", "sync_replicas")])

__all__ = sorted(list(_EXPORTS) + list(_MODULES))

# TensorFlow is not a requirement of the pip package (pyproject.toml says
# why), so a virtualenv without it is told here what to install, rather
# than meeting "No module named 'tensorflow'" deep inside a module (and the
# binaries print it in one line: cli.import_tensorflow).
INSTALL_TENSORFLOW = (
    "pip install tensorflow-cpu==2.21.* or 'tensorflow[and-cuda]==2.21.*' "
    "(or the extra tf1_safe_train[cpu] or [gpu])")
NO_TENSORFLOW = (
    "tf1_safe_train needs TensorFlow (2.21 is the version tested), which "
    "this Python does not have: " + INSTALL_TENSORFLOW)


def _load(module):
  if importlib.util.find_spec("tensorflow") is None:
    raise ImportError(NO_TENSORFLOW, name="tensorflow")
  return importlib.import_module(module)


def __getattr__(name):
  if name in _MODULES:
    return _load(_MODULES[name])
  if name in _MOVED:
    return _load(_MOVED[name])
  if name not in _EXPORTS:
    raise AttributeError("module 'tf1_safe_train' has no attribute %r" % name)
  return getattr(_load(_EXPORTS[name]), name)


def __dir__():
  return sorted(list(globals()) + __all__)
