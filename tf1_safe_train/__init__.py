"""tf1_safe_train: TF1 graph-mode training that skips non-finite steps."""

from tf1_safe_train.counters import skip_counters
from tf1_safe_train.counters import SkipCounters
from tf1_safe_train.optimizer import SkipNonFiniteOptimizer

__all__ = ["SkipCounters", "SkipNonFiniteOptimizer", "skip_counters"]
