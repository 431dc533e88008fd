"""Tests for tf1_safe_train.core.gradients."""

import tensorflow as tf

from tf1_safe_train.core import gradients

tf1 = tf.compat.v1


def _double(t):
  return t * 2.0


class MapValuesTest(tf.test.TestCase):

  def testDenseGradientIsMapped(self):
    with tf.Graph().as_default():
      out = gradients.map_values(_double, tf.constant([1.0, -3.0]))
      with self.cached_session():
        self.assertAllEqual([2.0, -6.0], self.evaluate(out))

  def testIndexedSlicesWithoutDenseShapeMapsValuesOnly(self):
    with tf.Graph().as_default():
      indices = tf.constant([2, 0])
      grad = tf.IndexedSlices(tf.constant([[1.0], [4.0]]), indices)
      out = gradients.map_values(_double, grad)
      self.assertIsInstance(out, tf.IndexedSlices)
      self.assertIs(indices, out.indices)
      self.assertIsNone(out.dense_shape)
      with self.cached_session():
        self.assertAllEqual([[2.0], [8.0]], self.evaluate(out.values))

  def testIndexedSlicesKeepsItsDenseShape(self):
    with tf.Graph().as_default():
      dense_shape = tf.constant([3, 1], tf.int64)
      grad = tf.IndexedSlices(tf.constant([[1.0]]), tf.constant([1]),
                              dense_shape)
      out = gradients.map_values(_double, grad)
      self.assertIs(grad.indices, out.indices)
      self.assertIs(dense_shape, out.dense_shape)
      with self.cached_session():
        self.assertAllEqual([[2.0]], self.evaluate(out.values))

  def testNoneStaysNoneAndFnIsNotCalled(self):
    calls = []
    self.assertIsNone(gradients.map_values(calls.append, None))
    self.assertEqual([], calls)


class MapGradientsTest(tf.test.TestCase):

  def testEachPairKeepsItsVariableAndOrder(self):
    with tf.Graph().as_default():
      a = tf1.get_variable("a", initializer=[1.0, 2.0])
      b = tf1.get_variable("b", initializer=[[1.0], [2.0]])
      c = tf1.get_variable("c", initializer=3.0)
      pairs = [(tf.constant([1.0, 2.0]), a),
               (tf.IndexedSlices(tf.constant([[5.0]]), tf.constant([1])), b),
               (None, c)]
      out = gradients.map_gradients(_double, pairs)
      self.assertEqual([a, b, c], [v for _, v in out])
      self.assertIsInstance(out[1][0], tf.IndexedSlices)
      self.assertIsNone(out[2][0])
      with self.cached_session():
        dense, sparse = self.evaluate([out[0][0], out[1][0].values])
      self.assertAllEqual([2.0, 4.0], dense)
      self.assertAllEqual([[10.0]], sparse)


if __name__ == "__main__":
  tf.test.main()
