"""Skip counters: how many steps were applied, skipped, and skipped in a row.

They are int64, non-trainable graph variables in `GLOBAL_VARIABLES`, created
once per graph, so `Saver` and `MonitoredTrainingSession` checkpoint them and a
restarted run continues counting where it stopped.
"""

import collections

import tensorflow as tf

tf1 = tf.compat.v1

SkipCounters = collections.namedtuple(
    "SkipCounters", ["applied_steps", "skipped_steps", "consecutive_skips"])
SkipCounters.__doc__ = """The skip counters of a graph (int64 variables or tensors).

Attributes:
  applied_steps: steps whose update was applied.
  skipped_steps: steps skipped because a gradient was non-finite.
  consecutive_skips: skipped steps since the last applied one (0 after an
    applied step).
"""

# The collection that holds the three variables, in SkipCounters order.
COLLECTION = "tf1_safe_train_skip_counters"


def skip_counters(graph=None):
  """Returns the graph's `SkipCounters`, creating them on first use.

  The variables are named `applied_steps`, `skipped_steps` and
  `consecutive_skips` at the root of the graph (whatever name scope is
  active), like `global_step`. They are created under `init_scope`, so calling
  this inside a `tf.cond` branch or a `control_dependencies` block is safe, and
  under the current device scope, so a `replica_device_setter` places them on a
  parameter server.

  Args:
    graph: the `tf.Graph`; default: the default graph.

  Returns:
    A `SkipCounters` of int64 scalar variables.
  """
  graph = graph or tf1.get_default_graph()
  existing = graph.get_collection(COLLECTION)
  if existing:
    return SkipCounters(*existing)
  with graph.as_default(), tf1.init_scope(), graph.name_scope(None):
    variables = []
    for name in SkipCounters._fields:
      variables.append(
          tf1.Variable(
              tf.constant(0, dtype=tf.int64),
              name=name,
              trainable=False,
              collections=[tf1.GraphKeys.GLOBAL_VARIABLES, COLLECTION]))
  return SkipCounters(*variables)


def read_after(counters, op):
  """Reads `counters` ordered after `op` (e.g. the train op).

  A raw variable read in the same `session.run` as the update is unordered
  relative to it; hooks must fetch these tensors instead.

  Args:
    counters: a `SkipCounters` of variables.
    op: an `Operation` or tensor the reads must follow.

  Returns:
    A `SkipCounters` of int64 tensors.
  """
  with tf1.name_scope("read_skip_counters"), tf1.control_dependencies([op]):
    return SkipCounters(*[tf.identity(c.read_value()) for c in counters])
