"""The trainer of //:train: its step (towers, precision, drills) and runner.

Built on `tf1_safe_train.core` (and its inputs, `data` and `models`); a
cluster's replication, `tf1_safe_train.cluster`, is built on it, never the
other way round (tests/layout_test.py).
"""
