"""The runner of //:train and //:eval: session, hooks, the
replication interface, signals, train_dir, the run summary,
a crash or a full disk told in one line.

(docs/layout.md: the map.)
"""
