"""Example ids: which examples a batch holds, and dropping examples by id.

An example id is an int64 that names one example of a source for good: its
index (synthetic), its file and record (CIFAR-10), an id feature of a user
pipeline, or else a hash of its content. Excluding ids drops those examples
from a pipeline, for example those whose skipped step reproduced.
"""

import numbers
import operator

import numpy as np
import tensorflow as tf


def normalize(exclude_ids):
  """Returns `exclude_ids` as a sorted, duplicate-free int64 NumPy array.

  Args:
    exclude_ids: an iterable of ints (Python or NumPy integers).

  Raises:
    ValueError: if an element is not an integer or does not fit int64.
  """
  if isinstance(exclude_ids, (str, bytes)) or not hasattr(
      exclude_ids, "__iter__"):
    raise ValueError("exclude_ids must be an iterable of ints, got %r" %
                     (exclude_ids,))
  values = []
  for value in exclude_ids:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise ValueError("exclude_ids must hold ints, got %r" % (value,))
    value = operator.index(value)
    if not -2**63 <= value < 2**63:
      raise ValueError("exclude_ids: %d does not fit int64" % value)
    values.append(value)
  return np.unique(np.array(values, np.int64))


def keep_fn(sorted_ids):
  """Returns a predicate on a scalar int64 id: True unless it is excluded.

  A binary search in one sorted constant: thousands of ids cost a few
  comparisons per example (a chain of `equal`s would grow with the set),
  and unlike a lookup table the constant needs no initializer, so one-shot
  iterators accept the pipeline.

  Args:
    sorted_ids: the output of `normalize`, not empty.
  """
  table = tf.constant(sorted_ids, tf.int64)
  last = len(sorted_ids) - 1

  def keep(example_id):
    position = tf.searchsorted(table, tf.reshape(example_id, [1]))[0]
    found = tf.gather(table, tf.minimum(position, last))
    return tf.not_equal(found, example_id)

  return keep


def content_ids(images):
  """Returns int64 [batch] ids hashing each example's bytes (`tf.fingerprint`).

  The same image always gets the same id; a randomly augmented example gets
  a new one each time it is drawn.
  """
  rows = tf.reshape(images, tf.stack([tf.shape(images)[0], -1]))
  return tf.reshape(tf.bitcast(tf.fingerprint(rows), tf.int64), [-1])


def _check_batches(dataset, what):
  spec = dataset.element_spec
  if not isinstance(spec, tuple) or len(spec) not in (2, 3):
    raise ValueError("%s: expected a dataset of (images, labels) or (images, "
                     "labels, ids) batches, got elements %s" % (what, spec))
  return spec


def with_ids(dataset):
  """Returns the batches of a user dataset with the ids of their examples.

  Args:
    dataset: a `tf.data.Dataset` of (images, labels) or (images, labels,
      ids) batches; ids are integers (cast to int64) or strings (hashed with
      `tf.fingerprint`), [batch].

  Returns:
    A `tf.data.Dataset` of (images, labels, ids int64 [batch]). Without an
    id feature, an example's id is a hash of its image (`content_ids`), so
    the same example always gets the same id, as long as the pipeline
    yields it unchanged (give randomly augmented data an id feature).

  Raises:
    ValueError: if the elements are not such tuples or the ids are neither
      integers nor strings.
  """
  spec = _check_batches(dataset, "with_ids")
  if len(spec) == 2:
    return dataset.map(lambda images, labels: (images, labels,
                                               content_ids(images)))
  dtype = spec[2].dtype
  if dtype == tf.int64:
    # Already ids: no map, which would cost every step a tf.data call.
    return dataset
  if dtype == tf.string:
    to_int64 = content_ids
  elif dtype.is_integer:
    to_int64 = lambda ids: tf.cast(ids, tf.int64)
  else:
    raise ValueError("with_ids: the ids feature must be integers or strings, "
                     "got %s" % dtype.name)
  return dataset.map(lambda images, labels, ids: (images, labels,
                                                  to_int64(ids)))


def exclude(dataset, exclude_ids, batch_size):
  """Drops examples by id from a batched (images, labels, ids) dataset.

  The batches are split into examples, filtered and batched again with
  `batch_size` (a partial last batch dropped). The images are already made
  at that point: `get_dataset(exclude_ids=...)` filters before making them.
  A user dataset that is repeated forever must keep some example, or the
  filter waits forever.

  Args:
    dataset: a `tf.data.Dataset` of (images, labels, ids) batches, e.g.
      from `with_ids`.
    exclude_ids: an iterable of int ids to drop.
    batch_size: examples per batch of the result, a positive int.

  Returns:
    `dataset` itself if `exclude_ids` is empty, else the filtered batches.

  Raises:
    ValueError: on bad `exclude_ids`, `batch_size` or elements.
  """
  sorted_ids = normalize(exclude_ids)
  batch_size = check_batch_size(batch_size)
  spec = _check_batches(dataset, "exclude")
  if len(spec) != 3 or spec[2].dtype != tf.int64:
    raise ValueError("exclude: expected (images, labels, ids int64) batches "
                     "(see with_ids), got elements %s" % (spec,))
  if not len(sorted_ids):
    return dataset
  keep = keep_fn(sorted_ids)
  return dataset.unbatch().filter(
      lambda images, labels, ids: keep(ids)).batch(batch_size,
                                                   drop_remainder=True)


def check_batch_size(batch_size):
  """Returns `batch_size` as an int; ValueError unless a positive int."""
  try:
    valid = not isinstance(batch_size, bool) and (
        operator.index(batch_size) > 0)
  except TypeError:
    valid = False
  if not valid:
    raise ValueError("batch_size must be a positive int, got %r" %
                     (batch_size,))
  return operator.index(batch_size)
