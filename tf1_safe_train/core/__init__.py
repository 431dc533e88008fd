"""The library a legacy script imports: the guard and what it needs; it
imports nothing of the folders above it.

`SkipNonFiniteOptimizer` (optimizer.py), the guard, rollback, counters, loss
scale, the skip report and the hooks a wrapper user needs. Nothing here
imports `tf1_safe_train.trainer` or `tf1_safe_train.cluster`
(tests/layout_test.py checks it). Users import the public names from the
top: `tf1_safe_train.SkipNonFiniteOptimizer`.
"""
