"""Replay probe: the first op whose output held a NaN or an Inf.

A `Probe` is built once over a step's inputs and outputs (a tower's images
and labels; its loss and gradients): one bool per op between them, in
topological order, True when every floating-point output of the op is
all-finite. `Probe.run` feeds a recorded batch and fetches that vector and
the inputs' non-finite rows in one `session.run`; `describe` turns the
`Finding` into one line (both in `replay_finding`, importable from here). A
skipped step leaves the weights as it saw them, so replaying its batch right
after the skip recomputes what the step saw.

Finiteness is tested with `is_finite` reductions, never `check_numerics`
(which raises, and whose `add_check_numerics_ops` refuses graphs with
control flow). The probe's ops are no ancestors of anything else: a run
that does not fetch them (every training step) never executes them.

What a replay cannot reproduce: stochastic ops among the probed ops
(dropout, random augmentation) draw new values, so a replay may differ from
the step (and be finite where the step was not); an input pipeline op that
is not cut off by a fed input (an `IteratorGetNext` whose every used output
is not among `inputs`) runs again and consumes a batch (warned at build);
ops that write variables and that the outputs depend on (update ops behind a
control dependency of the loss) write again (warned at build, `writes`).

Cost (ResNet-20 of `tf1_safe_train/models`, batch 128, its loss and
gradients, this project's 2-core CPU machine): the build probes 290 ops
and adds 1,468 ops (about 5 per probed op: 3 per checked tensor, and a
batch norm has 6), the graph growing from 1,658 ops to 3,126; one replay
(`Probe.run`) takes about as long as a training step: medians of 15
interleaved runs 0.12 to 0.27 s, against 0.12 to 0.20 s for a step (the
machine shared, load 5 to 6), since it runs the forward and backward passes
plus the checks, and no update.
"""

import time

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import op_walk
from tf1_safe_train.core import replay_finding

tf1 = tf.compat.v1

# What a replay found, and its line (kept importable from here).
Finding = replay_finding.Finding
describe = replay_finding.describe
as_record = replay_finding.as_record
phase_of = replay_finding.phase_of

# Op types that write a variable (a replay running them changes the model),
# and the prefixes of the optimizers' update ops.
_WRITE_OP_TYPES = frozenset([
    "Assign", "AssignAdd", "AssignSub", "AssignVariableOp",
    "AssignAddVariableOp", "AssignSubVariableOp", "ScatterUpdate",
    "ScatterAdd", "ScatterSub", "ScatterNdUpdate", "ResourceScatterUpdate",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterNdUpdate"])
_WRITE_PREFIXES = ("Apply", "ResourceApply", "SparseApply",
                   "ResourceSparseApply")
# Op types that consume an input pipeline's next element.
_ITERATOR_OP_TYPES = frozenset(["IteratorGetNext", "IteratorGetNextSync",
                                "IteratorGetNextAsOptional"])


def _values(tensor):
  """The dense values of an output (an IndexedSlices' values)."""
  return tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor


def _is_floating(tensor):
  return tensor.dtype.base_dtype.is_floating


def _all_finite(tensors, flat, axis):
  """Bool scalar: all of `tensors` are finite.

  Each is flattened by `flat` (the shared shape [-1]) and reduced over
  `axis` (the shared [0]): a static shape may lie about the rank, and
  shared constants keep the probe at 3 ops per tensor.
  """
  flags = [tf.reduce_all(tf.reshape(tf.math.is_finite(t), flat), axis)
           for t in tensors]
  return flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))


def _nonfinite_rows(tensor):
  """Bool [rows]: which rows along axis 0 hold a NaN or an Inf."""
  bad = tf.logical_not(tf.math.is_finite(tensor))
  return tf.reshape(
      tf.reduce_any(bad, axis=tf.range(1, tf.rank(tensor))), [-1])


class Probe(object):
  """Finiteness flags of every op between some inputs and some outputs."""

  def __init__(self, inputs, outputs, name="nonfinite_probe"):
    """Builds the probe in the default graph (before it is finalized).

    Args:
      inputs: tensors a replay feeds (a tower's images and labels, as its
        model read them); the walk from the outputs stops there.
      outputs: tensors whose computation is checked (loss, gradients;
        IndexedSlices are checked by their values; None is ignored).
      name: name scope of the probe's ops.

    Raises:
      ValueError: if no output is given.
    """
    self.inputs = [t for t in tf.nest.flatten(inputs) if t is not None]
    self.outputs = [_values(t) for t in tf.nest.flatten(outputs)
                    if t is not None]
    if not self.outputs:
      raise ValueError("Probe: no output to check (every output is None)")
    graph = self.outputs[0].graph
    stop = {t.name for t in self.inputs}
    walked = op_walk.ancestors(self.outputs, stop, control=False)
    executed = op_walk.ancestors(self.outputs, stop, control=True)
    # Outputs nothing reads (FusedBatchNormGradV3's reserve_space_4/5, which
    # come out with another rank than declared) cannot make a step
    # non-finite: only what the walk reads, and the outputs, are checked.
    used = {t.name for op in walked for t in op.inputs}
    used.update(t.name for t in self.outputs)
    probed, not_checked, seen_functions = [], 0, set()
    for op in op_walk.topological(walked):
      not_checked += op_walk.function_body_size(graph, op, seen_functions)
      floats = [t for t in op.outputs if _is_floating(t) and t.name in used]
      if not floats:
        continue
      if op._control_flow_context is not None:  # pylint: disable=protected-access
        not_checked += 1  # Dead or per-iteration: not fetchable from outside.
      else:
        probed.append((op, floats))
    self.op_names = [op.name for op, _ in probed]
    self.ops_not_checked = not_checked
    self.writes = sorted(op.name for op in executed
                         if op.type in _WRITE_OP_TYPES or
                         op.type.startswith(_WRITE_PREFIXES))
    self._placeholders = sorted(
        op.outputs[0].name for op in executed if op.type == "Placeholder")
    if self.writes:
      logging.warning(
          "replay probe %s: the outputs depend on ops that write variables "
          "(%s): a replay runs them again and changes what they write",
          name, ", ".join(self.writes[:5]) +
          (" (+%d more)" % (len(self.writes) - 5) if len(self.writes) > 5
           else ""))
    iterators = sorted(op.name for op in executed
                       if op.type in _ITERATOR_OP_TYPES)
    if iterators:
      logging.warning(
          "replay probe %s: %s is not cut off by the inputs: a replay "
          "consumes a batch of its pipeline", name, ", ".join(iterators))
    with graph.as_default(), tf1.control_dependencies(None), \
        tf1.name_scope(name):
      flat = tf.constant([-1], name="flat")
      axis = tf.constant([0], name="axis")
      flags = []
      for op, floats in probed:
        with tf.device(op.device):
          flags.append(_all_finite(floats, flat, axis))
      self._flags = (tf.stack(flags) if flags else
                     tf.zeros([0], tf.bool))
      self._output_flags = tf.stack(
          [_all_finite([t], flat, axis) for t in self.outputs])
      self._rows = {}
      for t in self.inputs:
        if _is_floating(t):
          with tf.device(t.device):
            self._rows[t.name] = _nonfinite_rows(t)

  @property
  def ops_checked(self):
    return len(self.op_names)

  def run(self, session, feed_dict):
    """Replays `feed_dict` through the probed ops; returns a `Finding`.

    One `session.run`: no variable is read or written other than by the
    probed ops themselves (see the module docstring for what differs).

    Args:
      session: a `tf.compat.v1.Session`, or `run_context.session` in a
        hook's `after_run`.
      feed_dict: the batch, as for `session.run` (keys: tensors or names).

    Raises:
      ValueError: if a placeholder the outputs need is not fed.
    """
    graph = self.outputs[0].graph
    fed = set()
    for key in feed_dict:
      element = graph.as_graph_element(key) if isinstance(key, str) else key
      fed.add(getattr(element, "name", str(element)))
    missing = [p for p in self._placeholders if p not in fed]
    if missing:
      raise ValueError("replay: feed_dict has no value for placeholder%s %s" %
                       ("s" if len(missing) > 1 else "", ", ".join(missing)))
    fetches = {"flags": self._flags, "outputs": self._output_flags,
               "rows": {n: t for n, t in self._rows.items() if n in fed}}
    start = time.time()
    values = session.run(fetches, feed_dict=feed_dict)
    seconds = time.time() - start
    bad = np.flatnonzero(~np.asarray(values["flags"], bool))
    first_op = self.op_names[bad[0]] if bad.size else None
    inputs = {n: np.flatnonzero(rows).tolist()
              for n, rows in sorted(values["rows"].items()) if rows.any()}
    outputs = [t.name for t, ok in zip(self.outputs, values["outputs"])
               if not ok]
    return Finding(
        finite=not (bad.size or inputs or outputs),
        nonfinite_inputs=inputs,
        first_op=first_op,
        phase=phase_of(first_op) if first_op else None,
        nonfinite_outputs=outputs,
        ops_checked=self.ops_checked,
        ops_not_checked=self.ops_not_checked,
        seconds=seconds)
