"""The trainer of //:train: its step (towers, precision, drills) and runner.

Built on `tf1_safe_train.core`; replication is in `tf1_safe_train.cluster`.
"""
