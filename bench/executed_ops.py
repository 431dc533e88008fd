"""How many graph nodes one `session.run` executes, from its step stats.

Timing on a shared machine is noisy; the number of nodes a step executes is
not. It is counted from `RunMetadata.step_stats` of a run traced with
`FULL_TRACE`: one `node_stats` entry per node the executor ran, on every
device. Counting graph nodes instead would miss what runs inside functions
(a control-flow-v2 `tf.cond` keeps its branches there until the lowering
pass inlines them) and would count nodes a step never runs (a cond's untaken
branch is dead, and dead nodes get no entry), and would miss what Grappler
rewrote (folded constants, fused chains of element-wise ops).
"""

import collections
import re

import tensorflow as tf

tf1 = tf.compat.v1

# A traced node's label: "<node name> = <op type>(<inputs>)".
_LABEL_OP_TYPE = re.compile(r" = (\w+)\(")
# GPU step stats list each kernel again under per-stream and memcpy
# pseudo-devices; only the executor's own device entries count.
_PSEUDO_DEVICE_MARKERS = ("/stream:", "/memcpy")


def trace_run(session, fetches, feed_dict=None):
  """Runs `fetches` once with full tracing; returns the `RunMetadata`.

  The run is a real one: a train op fetched here trains one step.
  """
  metadata = tf1.RunMetadata()
  session.run(fetches, feed_dict=feed_dict,
              options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
              run_metadata=metadata)
  return metadata


def executed_by_device(run_metadata):
  """Executed nodes per device of a traced run: ordered dict device -> count."""
  counts = collections.OrderedDict()
  for device_stats in run_metadata.step_stats.dev_stats:
    if any(m in device_stats.device for m in _PSEUDO_DEVICE_MARKERS):
      continue
    counts[device_stats.device] = (counts.get(device_stats.device, 0) +
                                   len(device_stats.node_stats))
  return counts


def executed_node_names(run_metadata):
  """Names of the nodes a traced run executed, sorted (one per execution)."""
  return sorted(node.node_name
                for device_stats in run_metadata.step_stats.dev_stats
                if not any(m in device_stats.device
                           for m in _PSEUDO_DEVICE_MARKERS)
                for node in device_stats.node_stats)


def executed_op_types(run_metadata):
  """Executed nodes of a traced run per op type: a `collections.Counter`.

  Where a step's extra nodes come from: e.g. a `tf.cond` adds a `Switch`
  per tensor its branches capture, and a finiteness check `IsFinite`,
  `All`, `LogicalNot` and the reduction's axes (`Const`). Nodes whose label
  names no op type count as "?".
  """
  counts = collections.Counter()
  for device_stats in run_metadata.step_stats.dev_stats:
    if any(m in device_stats.device for m in _PSEUDO_DEVICE_MARKERS):
      continue
    for node in device_stats.node_stats:
      match = _LABEL_OP_TYPE.search(node.timeline_label)
      counts[match.group(1) if match else "?"] += 1
  return counts


def executed_nodes(session, fetches, feed_dict=None):
  """Runs `fetches` once, traced; returns how many nodes it executed.

  Deterministic for a given graph and step path (an applied or a skipped
  step): the same count on every run once the session has run the graph
  once (the first run of a graph may also run one-off initialisation).

  Args:
    session: a `tf.compat.v1.Session`.
    fetches: what to run, e.g. a train op (one step is trained).
    feed_dict: optional feeds.

  Returns:
    An int: executed nodes summed over every device (each device's `_SOURCE`
    included), so differences between two ways of building a step cancel
    what both run.
  """
  return sum(executed_by_device(trace_run(session, fetches,
                                          feed_dict)).values())
