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

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError("module 'tf1_safe_train' has no attribute %r" % name)
  return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
  return sorted(list(globals()) + __all__)
