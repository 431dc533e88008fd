"""Walking a graph back from some tensors: ancestors, topological order.

The replay probe (`replay.Probe`) checks every op between a step's inputs
and its outputs; these functions find those ops, order them so that an
op's producers come first, and count what hides in function bodies.
"""

import collections
import heapq

import tensorflow as tf

from tf1_safe_train.core import fetch_gate


def ancestors(outputs, stop_names, control):
  """Ops `outputs` depend on, not going past tensors named in `stop_names`
  (the fetch gate's walk, from tensors)."""
  return fetch_gate.ancestors([t.op for t in outputs],
                              frozenset(stop_names), control=control)


def placeholders(outputs):
  """The placeholders `outputs` are computed from (IndexedSlices, None ok)."""
  outputs = [t.values if isinstance(t, tf.IndexedSlices) else t
             for t in tf.nest.flatten(outputs) if t is not None]
  return sorted((op.outputs[0] for op in ancestors(outputs, (), True)
                 if op.type == "Placeholder"), key=lambda t: t.name)


def topological(ops):
  """`ops` in topological order of their data edges, creation order first."""
  position = {op: i for i, op in enumerate(
      sorted(ops, key=lambda op: op._id))}  # pylint: disable=protected-access
  consumers = collections.defaultdict(list)
  waiting = {}
  for op in position:
    producers = {t.op for t in op.inputs if t.op in position}
    waiting[op] = len(producers)
    for producer in producers:
      consumers[producer].append(op)
  # A heap of positions: of the ops ready, the earliest created goes first.
  ready = [position[op] for op in position if not waiting[op]]
  heapq.heapify(ready)
  by_position = sorted(position, key=position.get)
  order = []
  while ready:
    op = by_position[heapq.heappop(ready)]
    order.append(op)
    for consumer in consumers[op]:
      waiting[consumer] -= 1
      if not waiting[consumer]:
        heapq.heappush(ready, position[consumer])
  # A v1 loop's back edge (NextIteration) makes a cycle: what is left when
  # nothing is ready goes last, in creation order.
  placed = set(order)
  return order + [op for op in by_position if op not in placed]


def _function_names(op):
  names = []
  for value in op.node_def.attr.values():
    if value.HasField("func"):
      names.append(value.func.name)
    names.extend(f.name for f in value.list.func)
  return names


def function_body_size(graph, op, seen):
  """Ops inside the functions `op` calls (v2 cond and loop bodies, calls)."""
  size = 0
  for name in _function_names(op):
    if name in seen:
      continue
    seen.add(name)
    function = graph._get_function(name)  # pylint: disable=protected-access
    if function is None:
      continue
    for node in function.definition.node_def:
      size += 1
      for value in node.attr.values():
        if value.HasField("func") and value.func.name not in seen:
          seen.add(value.func.name)
          nested = graph._get_function(value.func.name)  # pylint: disable=protected-access
          size += len(nested.definition.node_def) if nested else 0
  return size
