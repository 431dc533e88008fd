"""Shadow copies of variables written before a step's decision.

A skipped step must leave the variables that forward-pass update ops wrote
(batch-norm moving statistics) as they were; they are written before the
decision, so `rollback` keeps a copy of each in a shadow variable: the apply
branch copies the variables into their shadows, the skip branch copies them
back. Between steps a shadow always equals its variables.

Small variables of one device and dtype share one flat shadow (issue 16):
the apply branch then copies them with one assign of one concatenation,
which the decision's check of the written values reads anyway, instead of a
read, an assign and two captured handles per variable (ResNet-20's 38
statistics cost about 230 executed nodes per step that way, more than the
rest of the guard). Shadows are saved in checkpoints (a skip right after a
restart must restore the restored values); a flat shadow's name carries a
digest of its variables' names and shapes, so a checkpoint written for
other variables never fills it silently; a restore from a checkpoint
without it (one written by an older version, with a shadow per variable)
must fill it from the restored variables (`sync_shadows`; the trainer's
saver does).
"""

import collections
import zlib

import tensorflow as tf
# Only to keep the shadows' collection out of exported meta graphs (below).
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train.core import criteria

tf1 = tf.compat.v1

# Graph collection of `Shadow`s, so a variable gets one shadow per graph.
_COLLECTION = "tf1_safe_train_rollback_shadows"
# A meta-graph export (every checkpoint of a MonitoredTrainingSession) cannot
# serialize Python objects and would warn about them: export nothing (the
# shadows themselves are saved as the variables they are).
tf_ops.register_proto_function(
    _COLLECTION, to_proto=lambda shadow, export_scope=None: None)

# Variables up to this many elements share a flat shadow, and no flat
# shadow exceeds it: the concatenation copies bytes to save ops, a trade
# that pays for small tensors (as `nonfinite.MAX_FUSED_ELEMENTS`).
MAX_FLAT_ELEMENTS = 1 << 20


def is_ref_variable(variable):
  return not hasattr(variable, "handle")


def read_written(variable):
  """`variable`'s value, read when the op using it runs.

  A ref variable's ref itself: Grappler may rewrite an Identity read of a
  ref variable (`read_value()`) into the variable's cached snapshot, which
  can run before the updates the caller's control dependencies name.
  """
  if is_ref_variable(variable):
    return variable._ref()  # pylint: disable=protected-access
  return variable.read_value()


class Shadow(object):
  """One shadow variable for `variables` (one, or several flattened)."""

  def __init__(self, variables):
    first = variables[0]
    self.variables = tuple(variables)
    self.flat = len(variables) > 1
    graph = first.graph
    if self.flat:
      shapes = [v.shape.as_list() for v in variables]
      self._sizes = [v.shape.num_elements() for v in variables]
      described = ";".join("%s%s" % (v.op.name, s)
                           for v, s in zip(variables, shapes))
      name = "%s/skip_shadow_of_%d_%08x" % (
          first.op.name, len(variables), zlib.crc32(described.encode()))
      # A restore from a checkpoint that lacks it fills it (`sync_shadows`).
      initial = lambda: tf.concat(
          [tf.reshape(v.initial_value, [-1]) for v in variables], 0)
      collections_ = [tf1.GraphKeys.GLOBAL_VARIABLES, criteria.OPTIONAL_STATE]
    else:
      name = first.op.name + "/skip_shadow"
      initial = lambda: first.initial_value
      collections_ = [tf1.GraphKeys.GLOBAL_VARIABLES]
    with tf1.init_scope(), graph.name_scope(None), graph.colocate_with(first):
      self.shadow = tf1.Variable(
          initial, name=name, trainable=False, collections=collections_,
          use_resource=not is_ref_variable(first))

  def value(self):
    """The variables' current value as the shadow holds it (read when the
    op using it runs, after the caller's control dependencies)."""
    if not self.flat:
      return read_written(self.variables[0])
    first = self.variables[0]
    with first.graph.colocate_with(first):
      return tf.concat([read_written(v) if v.shape.rank == 1 else
                        tf.reshape(read_written(v), [-1])
                        for v in self.variables], 0)

  def commit(self, value=None):
    """The shadow takes `value` (from `value()`), or the variables' now."""
    if value is None:
      value = (self.variables[0].read_value() if not self.flat
               else self.value())
    return tf1.assign(self.shadow, value)

  def restore(self):
    """The variables take back the shadow's value."""
    saved = self.shadow.read_value()
    if not self.flat:
      return tf1.assign(self.variables[0], saved)
    pieces = tf.split(saved, self._sizes)
    return tf.group(*[tf1.assign(v, p if v.shape.rank == 1 else
                                 tf.reshape(p, v.shape))
                      for v, p in zip(self.variables, pieces)])


def _flattenable(variable):
  size = variable.shape.num_elements()
  return size is not None and size <= MAX_FLAT_ELEMENTS


def shadows_for(variables):
  """The shadows holding `variables`, created for those that have none.

  A variable already shadowed (by an earlier step of the graph) keeps its
  shadow, shared whole with its other variables: between steps a shadow
  equals all its variables, so restoring one not written this step writes
  its value again. New small variables are grouped by device, dtype and
  kind (ref or resource) into flat shadows of at most `MAX_FLAT_ELEMENTS`.

  Args:
    variables: the variables to protect.

  Returns:
    A list of `Shadow`s, each once.
  """
  if not variables:
    return []
  graph = variables[0].graph
  owner = {}
  for shadow in graph.get_collection(_COLLECTION):
    for v in shadow.variables:
      owner[id(v)] = shadow
  found, new, seen = [], [], set()
  for v in variables:
    if id(v) in seen:
      continue
    seen.add(id(v))
    shadow = owner.get(id(v))
    if shadow is None:
      new.append(v)
    elif all(shadow is not s for s in found):
      found.append(shadow)
  groups = collections.OrderedDict()
  for v in new:
    key = ((v.device, v.dtype.base_dtype, is_ref_variable(v))
           if _flattenable(v) else ("alone", id(v)))
    groups.setdefault(key, []).append(v)
  for vs in groups.values():
    for batch in _batches(vs):
      shadow = Shadow(batch)
      graph.add_to_collection(_COLLECTION, shadow)
      found.append(shadow)
  return found


def _batches(variables):
  """`variables` in runs of at most `MAX_FLAT_ELEMENTS` elements."""
  batch, size = [], 0
  for v in variables:
    elements = v.shape.num_elements() or 0
    if batch and size + elements > MAX_FLAT_ELEMENTS:
      yield batch
      batch, size = [], 0
    batch.append(v)
    size += elements
  if batch:
    yield batch


def shadowed(graph):
  """{shadow variable's op: set of the ops of the variables it holds}."""
  return {s.shadow.op: set(v.op for v in s.variables)
          for s in graph.get_collection(_COLLECTION)}


def sync_shadows(variables=None, graph=None):
  """An op: shadows take their variables' values now; None if there are none.

  Run it once after a restore that did not fill the shadows (a checkpoint
  written before the wrapper, or by an older version with a shadow per
  statistic, restored with a `Saver` over the variables it has): a shadow
  left at its initial value would undo the restored statistics on the
  first skip.

  Args:
    variables: only the shadows among these (e.g. the variables a restore
      initialised afresh); default: every shadow of `graph`.
    graph: default: the default graph (or the variables').
  """
  if variables is not None and not variables:
    return None
  graph = graph or (variables[0].graph if variables
                    else tf1.get_default_graph())
  ids = None if variables is None else set(id(v) for v in variables)
  ops = [s.commit() for s in graph.get_collection(_COLLECTION)
         if ids is None or id(s.shadow) in ids]
  if not ops:
    return None
  with graph.as_default():
    return tf.group(*ops, name="sync_shadows")
