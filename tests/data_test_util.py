"""A TestCase that runs datasets built in a fresh graph (the data tests')."""

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


class GraphTestCase(tf.test.TestCase):
  """Runs datasets built in a fresh graph and returns their batches."""

  def _batches(self, make_dataset, num_batches=None):
    """Returns the first `num_batches` elements (all if None) as NumPy."""
    with tf.Graph().as_default() as graph, self.session(graph=graph):
      next_element = tf1.data.make_one_shot_iterator(
          make_dataset()).get_next()
      batches = []
      while num_batches is None or len(batches) < num_batches:
        try:
          batches.append(self.evaluate(next_element))
        except tf.errors.OutOfRangeError:
          break
      return batches

  def _columns(self, make_dataset, num_batches=None):
    """Returns the batches concatenated per component."""
    batches = self._batches(make_dataset, num_batches)
    return tuple(np.concatenate(column) for column in zip(*batches))

  def _arrays(self, make_dataset, num_batches=None):
    """Returns the batches concatenated into (images, labels)."""
    return self._columns(make_dataset, num_batches)[:2]
