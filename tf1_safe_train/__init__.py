"""tf1_safe_train: TF1 graph-mode training that skips non-finite steps.

The public names are loaded on first use, so that `import tf1_safe_train.cli`
(what the binaries do before parsing flags) does not start TensorFlow.
"""

import importlib

_EXPORTS = {
    "GiveUpHook": "tf1_safe_train.hooks",
    "SkipCounters": "tf1_safe_train.counters",
    "skip_counters": "tf1_safe_train.counters",
    "SkipNonFiniteOptimizer": "tf1_safe_train.optimizer",
}
# Modules a legacy script uses by name: tf1_safe_train.summaries.histogram.
_MODULES = ("summaries",)

__all__ = sorted(list(_EXPORTS) + list(_MODULES))


def __getattr__(name):
  if name in _MODULES:
    return importlib.import_module("tf1_safe_train." + name)
  if name not in _EXPORTS:
    raise AttributeError("module 'tf1_safe_train' has no attribute %r" % name)
  return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
  return sorted(list(globals()) + __all__)
