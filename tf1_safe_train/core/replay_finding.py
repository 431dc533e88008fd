"""What a replay found (`Finding`), and its one line (`describe`).

A `replay.Probe` run returns a `Finding`: the inputs' non-finite rows, the
first op whose output held a NaN or an Inf and whether the forward or the
backward pass built it. `describe` says it in one line, `as_record` as the
skips.jsonl dict.
"""

import collections
import re

import numpy as np

# A name scope component of tf.gradients: "gradients", "gradients_1", ...
_GRADIENTS_SCOPE = re.compile(r"^gradients(_\d+)?$")
# How many rows or ids `describe` lists before "+N more".
_MAX_SHOWN = 10


class Finding(collections.namedtuple("Finding", [
    "finite", "nonfinite_inputs", "first_op", "phase", "nonfinite_outputs",
    "ops_checked", "ops_not_checked", "seconds"
])):
  """What one replay found; `str()` is its `describe` line.

  Attributes:
    finite: True if every probed value, input and output was finite.
    nonfinite_inputs: {input tensor name: [row indices along axis 0 holding a
      NaN or an Inf]}, only for fed inputs with such rows.
    first_op: name of the first op (topological order) with a non-finite
      floating-point output, or None.
    phase: "forward", or "backward" when `first_op` was built by
      `tf.gradients` (a `gradients` name scope); None without `first_op`.
    nonfinite_outputs: names of the outputs that were not all-finite.
    ops_checked: how many ops were probed.
    ops_not_checked: how many ops between the inputs and the outputs could
      not be fetched from outside (in a v1 cond or loop, in a function body).
    seconds: wall time of the replay's `session.run`.
  """
  __slots__ = ()

  def __str__(self):
    return describe(self)


def phase_of(op_name):
  """'backward' if `op_name` is in a tf.gradients name scope, else 'forward'."""
  scopes = op_name.split("/")[:-1]
  if any(_GRADIENTS_SCOPE.match(s) for s in scopes):
    return "backward"
  return "forward"


def _shown(values):
  values = list(values)
  text = ", ".join(str(v) for v in values[:_MAX_SHOWN])
  if len(values) > _MAX_SHOWN:
    text += ", ... (+%d more)" % (len(values) - _MAX_SHOWN)
  return "[%s]" % text


def describe(finding, example_ids=None):
  """One line for a `Finding`.

  E.g. "input finite; first non-finite: tower_1/small_cnn/conv2/Relu
  (forward)", "input holds NaN/Inf: rows [3, 4] (examples [4711, 4712]);
  first non-finite: ...", "finite on replay".

  Args:
    finding: a `Finding`.
    example_ids: optional ids of the batch's examples, by row.
  """
  if finding.finite:
    return "finite on replay"
  if finding.nonfinite_inputs:
    by_input = finding.nonfinite_inputs
    if len(by_input) == 1:
      line = "input holds NaN/Inf: rows %s" % _shown(*by_input.values())
    else:
      line = "input holds NaN/Inf: %s" % ", ".join(
          "%s rows %s" % (n, _shown(r)) for n, r in by_input.items())
    if example_ids is not None:
      rows = sorted({r for rows in by_input.values() for r in rows})
      ids = [example_ids[r] for r in rows if r < len(example_ids)]
      line += " (examples %s)" % _shown(int(i) if isinstance(
          i, (int, np.integer)) else i for i in ids)
  else:
    line = "input finite"
  if finding.first_op:
    line += "; first non-finite: %s (%s)" % (finding.first_op, finding.phase)
  elif finding.nonfinite_outputs:
    line += ("; first non-finite: not among the %d probed ops (%d not "
             "checked); outputs: %s" % (finding.ops_checked,
                                         finding.ops_not_checked,
                                         ", ".join(finding.nonfinite_outputs)))
  return line


def as_record(finding, example_ids=None):
  """A `Finding` as a JSON-ready dict (for skips.jsonl), with its line."""
  record = finding._asdict()
  record["summary"] = describe(finding, example_ids)
  return record
