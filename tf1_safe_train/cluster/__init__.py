"""The trainer's replication, built on the trainer (never imported by it).

Strategies, replicas on TF gRPC, the cluster spec and flags, and the
launcher of //:local_cluster; its strategies subclass the trainer's `Local`
(`trainer/run/local_replication.py`).
"""
