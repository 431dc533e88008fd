"""The trainer's replication: strategies, replicas on TF gRPC, the cluster
spec and flags, and the launcher of //:local_cluster. Built on the trainer
(its strategies subclass `trainer.local_replication.Local`), which never
imports it.
"""
