"""Each tower's last batch, kept where the input is, read only on a skip.

What a `session.run` fetches is fixed before the step runs, so a skip can
only be explained afterwards if the step left its batch somewhere: every
step writes each tower's images, labels and example ids (as its model read
them) into local variables on the input's device. Good steps pay a copy of
the batch on that device and fetch nothing; only a skip reads the store.
Local variables are not checkpointed (a restart has no last batch).

A replay feeds `replaying` True: the towers then take their batch from the
store instead of the training iterator (`tower_input`), so nothing a replay
runs can consume training input.

The store also keeps tower 0's last *applied* batch (and its step): a batch
known to be data a step learned from, which a replay tries on the skip's
weights to tell a batch-specific failure (the data) from weights that fail
on every batch (the model). An applied step pays one more copy of that
batch; the first skip of a process before any applied step has none.
"""

import hashlib

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


def _slot(name, spec, initial=0):
  """A local variable that can hold any value of `spec` (a `tf.TensorSpec`)."""
  shape = spec.shape
  if shape.is_fully_defined():
    initial = tf.fill(shape, tf.constant(initial, spec.dtype))
  else:  # E.g. a user dataset's last batch may be smaller.
    initial = tf.zeros([0] * (shape.rank or 0), spec.dtype)
    shape = tf.TensorShape(None)
  return tf1.Variable(initial, trainable=False, shape=shape, name=name,
                      collections=[tf1.GraphKeys.LOCAL_VARIABLES],
                      use_resource=True)


class BatchStore(object):
  """Per-tower slots for the batch a step read.

  Build it under the input's device scope; `write` each tower's batch there
  too (so nothing crosses devices) and group the ops into the train op.
  """

  def __init__(self, element_spec, num_towers, name="batch_store"):
    """Creates the slots.

    Args:
      element_spec: (images, labels, ids) `tf.TensorSpec`s of a batch.
      num_towers: towers of this worker.
      name: name scope of the variables.
    """
    self._slots, self._reads = [], []
    self._spec = tuple(element_spec)
    with tf1.name_scope(name + "/"):
      # Fed True by a replay only (see the module doc).
      self.replaying = tf1.placeholder_with_default(False, [],
                                                    name="replaying")
      for tower in range(num_towers):
        with tf1.name_scope("tower_%d" % tower):
          slots = tuple(_slot(n, s) for n, s in zip(
              ("images", "labels", "ids"), element_spec))
          self._slots.append(slots)
          # Built now: the session's graph is finalized before a skip.
          self._reads.append(tuple(v.read_value() for v in slots))
    # Not under `name`: readers of the towers' slots match "batch_store/".
    with tf1.name_scope("last_applied_batch/"):
      self._applied = tuple(_slot(n, s) for n, s in zip(
          ("images", "labels", "ids"), element_spec)) + (_slot(
              "step", tf.TensorSpec([], tf.int64), initial=-1),)
      self._applied_reads = tuple(v.read_value() for v in self._applied)

  @property
  def num_towers(self):
    return len(self._slots)

  def write(self, tower, images, labels, ids):
    """The op that stores `tower`'s batch (build it on the input's device)."""
    return tf.group(*[s.assign(t, read_value=False) for s, t in zip(
        self._slots[tower], (images, labels, ids))], name="store_batch")

  def values(self, tower):
    """(images, labels, ids) tensors of `tower`'s stored batch, shaped as
    the input's batches (build them where they are used)."""
    values = []
    for variable, spec in zip(self._slots[tower], self._spec):
      value = variable.read_value()
      value.set_shape(spec.shape)
      values.append(value)
    return tuple(values)

  def keep_if_applied(self, applied, step, images, labels, ids):
    """The op that keeps (images, labels, ids) of `step` as the last applied
    batch when `applied` (build it on the input's device)."""
    def keep():
      return tf.group(*[s.assign(t, read_value=False) for s, t in zip(
          self._applied, (images, labels, ids, step))])
    return tf.cond(applied, keep, tf.no_op, name="keep_applied_batch")

  def read_applied(self, session):
    """The last applied (images, labels, ids, step), or None if none yet."""
    images, labels, ids, step = session.run(list(self._applied_reads))
    return None if step < 0 else (images, labels, ids, int(step))

  def variables(self, tower):
    """(images, labels, ids) variables of `tower`."""
    return self._slots[tower]

  def read(self, session, tower):
    """The stored (images, labels, ids) of `tower`, NumPy arrays."""
    return tuple(session.run(list(self._reads[tower])))


def batch_hash(images, labels):
  """A short hex digest of a batch's images and labels (same batch, same
  hash: two skips can be told to be the same data)."""
  digest = hashlib.sha256()
  for array in (images, labels):
    array = np.ascontiguousarray(array)
    digest.update(str(array.dtype).encode() + str(array.shape).encode())
    digest.update(array.tobytes())
  return digest.hexdigest()[:16]
