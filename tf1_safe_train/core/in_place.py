"""In-place writes: variables the ops a step runs before its decision write.

Batch norm with `updates_collections=None` (the contrib/tf-slim idiom DCGAN
uses) assigns its moving statistics in the forward pass: the normalized
output waits for the assign (a control dependency), so every run of the loss
writes them, and nothing lists them in `UPDATE_OPS`. `run_before` finds such
writes among the ancestors of a step's losses and gradients, so the step
rolls them back on a skip as it does update ops.
"""

import tensorflow as tf

from tf1_safe_train.core import cond_walk
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import shadows as shadows_lib
from tf1_safe_train.core import writes

tf1 = tf.compat.v1

_MERGE_OP_TYPES = frozenset(["Merge", "RefMerge"])


def _decision_contexts(decisions):
  """The v1 cond branch contexts of registered decisions (their Merges)."""
  found = set()
  for op in decisions:
    if op.type in _MERGE_OP_TYPES:
      for tensor in op.inputs:
        found.update(cond_walk.contexts(tensor.op))
  return found


def _left_to_the_step(graph):
  """Ops of variables a step handles itself: global_step, the counters, the
  shadows (written inside decisions)."""
  variables = (graph.get_collection(tf1.GraphKeys.GLOBAL_STEP) +
               graph.get_collection(counters_lib.COLLECTION))
  return set(v.op for v in variables) | set(shadows_lib.shadowed(graph))


def _outputs_of(cond):
  """The identities `tf.cond` (v2) returns for `cond`'s outputs.

  What waits for them waits for the branch's outputs, which in-place batch
  norm computes after its assigns. Not the cond op itself: lowered, a
  control edge from it waits only for the branch to start.
  """
  return [c for t in cond.outputs for c in t.consumers()
          if c.type == "Identity" and not cond_walk.contexts(c)]


def _candidates(roots):
  """Ops among the ancestors of `roots` that may write variables.

  A write op outside control flow; for a write inside a v1 cond (not a
  loop), the cond's Merge the walk came through; for a v2 cond, the
  identities of its outputs (`_outputs_of`). The walk does not enter the
  graph's decisions (`writes.register_decision`): what they write is the
  steps' own business.
  """
  graph = roots[0].graph
  decisions = writes.decisions(graph)
  inside_decisions = _decision_contexts(decisions)
  found, seen = [], set()
  stack = [(op, None) for op in reversed(roots)]
  while stack:
    op, merge = stack.pop()
    if op in seen or op in decisions:
      continue
    seen.add(op)
    contexts = cond_walk.contexts(op)
    if any(c in inside_decisions for c in contexts):
      continue
    if op.type in cond_walk.V2_COND_OP_TYPES:
      found.extend(_outputs_of(op))
    elif op.type in writes.WRITE_OP_TYPES:
      if not contexts:
        found.append(op)
      elif merge is not None and not any(c.IsWhileContext()
                                         for c in contexts):
        found.append(merge)
    if not contexts:
      merge = op if op.type in _MERGE_OP_TYPES else None
    stack.extend((c, merge) for c in reversed(op.control_inputs))
    stack.extend((t.op, merge) for t in reversed(op.inputs))
  return found


def run_before(roots, own=()):
  """The ops among the ancestors of `roots` that write variables in place.

  What a step given `roots` (its gradients' and losses' ops, the caller's
  control dependencies) runs anyway and must roll back on a skip, as update
  ops: assigns (and scatters) of graph variables outside control flow, and
  the conds that write some (a v1 cond's Merge, a v2 cond's outputs: batch
  norm with a tensor `training`). Left out (the write check names those it
  sees): writes inside loops or function calls, conds whose writes
  `writes.find_writes` cannot analyse, and any op or cond that also writes
  `global_step`, a skip counter, a rollback shadow or one of `own`.

  Args:
    roots: Operations.
    own: more variables the step writes itself (its `global_step`).

  Returns:
    A list of Operations, each once, in the order found.
  """
  if not roots:
    return []
  left = _left_to_the_step(roots[0].graph) | set(v.op for v in own)
  kept = []
  for op in _candidates(roots):
    if op in kept:  # A cond's Merge, found through each of its writes.
      continue
    try:
      written, _ = writes.find_writes([op])
    except ValueError:
      continue  # Not analysable here: the write check names it.
    if written and not any(v.op in left for _, v in written):
      kept.append(op)
  return kept
