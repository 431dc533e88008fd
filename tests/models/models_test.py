"""Tests of the reference models and their layers."""

import numpy as np
import tensorflow as tf

from tf1_safe_train import models
from tf1_safe_train.models import layers
from tf1_safe_train.models import resnet

tf1 = tf.compat.v1

# Two examples, one row of two pixels, two channels. Channel 0 holds
# 1, 3, 5, 7 (mean 4, unbiased variance 20/3, biased variance 5); channel 1
# holds 10, 20, 30, 40 (mean 25, unbiased variance 500/3).
_TINY = np.array([[[[1., 10.], [3., 20.]]],
                  [[[5., 30.], [7., 40.]]]], np.float32)
_TINY_MEAN = np.array([4., 25.], np.float32)
_TINY_UNBIASED_VAR = np.array([20. / 3., 500. / 3.], np.float32)


def _num_params(variables):
  return sum(int(np.prod(v.shape)) for v in variables)


def _update_ops():
  return tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)


def _images(batch=2):
  return tf.constant(
      np.random.RandomState(0).randn(batch, 32, 32, 3).astype(np.float32))


class GetModelTest(tf.test.TestCase):

  def testReturnsEachModel(self):
    self.assertEqual(models.MODEL_NAMES, ("resnet20", "resnet8", "small_cnn"))
    for name in models.MODEL_NAMES:
      self.assertTrue(callable(models.get_model(name)))

  def testRejectsUnknownName(self):
    with self.assertRaisesRegex(ValueError, "resnet50"):
      models.get_model("resnet50")
    with self.assertRaisesRegex(ValueError, "None"):
      models.get_model(None)


class ModelTest(tf.test.TestCase):

  def testOutputShapes(self):
    for name in models.MODEL_NAMES:
      for num_classes in (10, 7):
        with tf.Graph().as_default() as graph, self.session(graph=graph):
          logits = models.get_model(name)(_images(), True,
                                          num_classes=num_classes)
          self.assertEqual(logits.dtype, tf.float32)
          self.assertEqual(logits.shape.as_list(), [2, num_classes])
          self.evaluate(tf1.global_variables_initializer())
          value = self.evaluate(logits)
          self.assertFalse(np.isnan(value).any(), name)

  def testRejectsBadInputs(self):
    for name in models.MODEL_NAMES:
      model_fn = models.get_model(name)
      with tf.Graph().as_default():
        with self.assertRaisesRegex(ValueError, "float32"):
          model_fn(tf.zeros([2, 32, 32, 3], tf.uint8), True)
        with self.assertRaisesRegex(ValueError, "height, width, 3"):
          model_fn(tf.zeros([2, 32, 32, 1]), True)
        with self.assertRaisesRegex(ValueError, "num_classes"):
          model_fn(tf.zeros([2, 32, 32, 3]), True, num_classes=0)

  def testVariablesAreSharedAcrossTowers(self):
    for name in models.MODEL_NAMES:
      with tf.Graph().as_default() as graph, self.session(graph=graph):
        images = _images()
        logits = []
        for i in range(2):
          with tf1.variable_scope(tf1.get_variable_scope(), reuse=i > 0):
            with tf1.name_scope("tower_%d" % i):
              logits.append(models.get_model(name)(images, False))
            if i == 0:
              first_variables = tf1.global_variables()
        self.assertEqual(tf1.global_variables(), first_variables)
        self.evaluate(tf1.global_variables_initializer())
        tower0, tower1 = self.evaluate(logits)
        self.assertAllClose(tower0, tower1)

  def testKernelsAreNamedWeights(self):
    for name in models.MODEL_NAMES:
      with tf.Graph().as_default():
        models.get_model(name)(_images(), True)
        for var in tf1.trainable_variables():
          self.assertIn(var.op.name.split("/")[-1],
                        ("weights", "biases", "beta", "gamma"))
          if var.shape.rank >= 2:
            self.assertTrue(var.op.name.endswith("/weights"), var.op.name)

  def testSmallCnnHasNoBatchNorm(self):
    with tf.Graph().as_default():
      models.get_model("small_cnn")(_images(), True)
      self.assertEmpty(_update_ops())
      self.assertEqual(tf1.global_variables(), tf1.trainable_variables())
      self.assertLen(tf1.trainable_variables(), 10)  # 5 layers x (w, b).


class Resnet20Test(tf.test.TestCase):

  def testLayerAndParameterCounts(self):
    with tf.Graph().as_default():
      resnet.resnet20(_images(), True)
      names = [v.op.name for v in tf1.trainable_variables()]
      convs = [n for n in names if n.endswith("/conv/weights")]
      self.assertLen(convs, 19)  # 1 + 3 stages x 3 blocks x 2.
      self.assertLen([n for n in names if n.endswith("/gamma")], 19)
      self.assertLen([n for n in names if n.endswith("/biases")], 1)
      # He et al. quote 0.27M; option A shortcuts add no parameters.
      self.assertEqual(_num_params(tf1.trainable_variables()), 269722)
      moving = [v for v in tf1.global_variables()
                if v not in tf1.trainable_variables()]
      self.assertLen(moving, 38)

  def testProjectionShortcutAddsTwoConvolutions(self):
    with tf.Graph().as_default():
      logits = resnet.resnet20(_images(), True, shortcut="B")
      self.assertEqual(logits.shape.as_list(), [2, 10])
      convs = [v for v in tf1.trainable_variables()
               if v.op.name.endswith("/conv/weights")]
      self.assertLen(convs, 21)
      with self.assertRaisesRegex(ValueError, "'C'"):
        resnet.resnet20(_images(), True, shortcut="C")

  def testTrainingAddsTwoUpdateOpsPerBatchNorm(self):
    with tf.Graph().as_default():
      resnet.resnet20(_images(), True)
      self.assertLen(_update_ops(), 2 * 19)
      for i in range(2):
        with tf1.variable_scope(tf1.get_variable_scope(), reuse=True):
          with tf1.name_scope("tower_%d" % i):
            resnet.resnet20(_images(), True)
        self.assertLen(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS,
                                          scope="tower_%d" % i), 2 * 19)

  def testInferenceAddsNoUpdateOps(self):
    with tf.Graph().as_default():
      resnet.resnet20(_images(), False)
      self.assertEmpty(_update_ops())


class Resnet8Test(tf.test.TestCase):

  def testLayerParameterAndUpdateOpCounts(self):
    with tf.Graph().as_default():
      logits = resnet.resnet8(_images(), True)
      self.assertEqual(logits.shape.as_list(), [2, 10])
      names = [v.op.name for v in tf1.trainable_variables()]
      self.assertTrue(all(n.startswith("resnet8/") for n in names), names)
      convs = [n for n in names if n.endswith("/conv/weights")]
      self.assertLen(convs, 7)  # 1 + 3 stages x 1 block x 2.
      self.assertLen([n for n in names if n.endswith("/gamma")], 7)
      self.assertEqual(_num_params(tf1.trainable_variables()), 75290)
      self.assertLen(_update_ops(), 2 * 7)
      with self.assertRaisesRegex(ValueError, "resnet8: shortcut"):
        resnet.resnet8(_images(), True, shortcut="C")


class BatchNormTest(tf.test.TestCase):

  def tearDown(self):
    tf1.enable_resource_variables()
    super().tearDown()

  def _variables(self):
    return {v.op.name.split("/")[-1]: v for v in tf1.global_variables()}

  def _checkTrainingUpdate(self):
    with tf.Graph().as_default() as graph, self.session(graph=graph):
      y = layers.batch_norm(tf.constant(_TINY), True, "bn", decay=0.9)
      variables = self._variables()
      self.assertEqual(sorted(variables),
                       ["beta", "gamma", "moving_mean", "moving_variance"])
      self.assertEqual(
          sorted(v.op.name for v in tf1.trainable_variables()),
          ["bn/beta", "bn/gamma"])
      updates = _update_ops()
      self.assertLen(updates, 2)
      self.evaluate(tf1.global_variables_initializer())
      # The output uses the batch's (biased) statistics.
      expected = (_TINY - _TINY_MEAN) / np.sqrt(
          np.array([5., 125.]) + 1e-3)
      self.assertAllClose(self.evaluate(y), expected, rtol=1e-5)
      # Not a control dependency of the output: computing y updates nothing.
      self.assertAllEqual(self.evaluate(variables["moving_mean"]), [0., 0.])
      self.evaluate(updates)
      # var -= (var - batch_stat) * (1 - decay), from 0 and 1.
      mean1 = 0.1 * _TINY_MEAN
      var1 = 1. + 0.1 * (_TINY_UNBIASED_VAR - 1.)
      self.assertAllClose(self.evaluate(variables["moving_mean"]), mean1)
      self.assertAllClose(self.evaluate(variables["moving_variance"]), var1)
      self.evaluate(updates)
      self.assertAllClose(self.evaluate(variables["moving_mean"]),
                          mean1 + 0.1 * (_TINY_MEAN - mean1))
      return variables

  def testTrainingUpdateMovesMovingStatisticsByOneMinusDecay(self):
    variables = self._checkTrainingUpdate()
    self.assertTrue(hasattr(variables["moving_mean"], "handle"))

  def testTrainingUpdateWithRefVariables(self):
    was_enabled = tf1.resource_variables_enabled()
    tf1.disable_resource_variables()
    try:
      variables = self._checkTrainingUpdate()
    finally:
      if was_enabled:
        tf1.enable_resource_variables()
    self.assertFalse(hasattr(variables["moving_mean"], "handle"))

  def testInferenceUsesMovingStatistics(self):
    with tf.Graph().as_default() as graph, self.session(graph=graph):
      y = layers.batch_norm(tf.constant(_TINY), False, "bn")
      self.assertEmpty(_update_ops())
      variables = self._variables()
      self.evaluate(tf1.global_variables_initializer())
      self.evaluate([variables["moving_mean"].assign([2., 20.]),
                     variables["moving_variance"].assign([4., 16.]),
                     variables["gamma"].assign([1., 2.]),
                     variables["beta"].assign([0.5, -1.])])
      expected = (np.array([1., 2.]) * (_TINY - [2., 20.]) /
                  np.sqrt(np.array([4., 16.]) + 1e-3) + [0.5, -1.])
      self.assertAllClose(self.evaluate(y), expected, rtol=1e-5)

  def testRejectsNonBoolIsTraining(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, "is_training"):
        layers.batch_norm(tf.constant(_TINY), tf.constant(True), "bn")


class ConvAndDenseTest(tf.test.TestCase):

  def testConvShapesAndVariables(self):
    with tf.Graph().as_default():
      y = layers.conv2d(_images(), 8, 3, 2, scope="c", use_bias=False)
      self.assertEqual(y.shape.as_list(), [2, 16, 16, 8])
      self.assertEqual([v.op.name for v in tf1.global_variables()],
                       ["c/weights"])
      z = layers.dense(tf.zeros([2, 5]), 4, "d")
      self.assertEqual(z.shape.as_list(), [2, 4])
      self.assertEqual([v.op.name for v in tf1.global_variables()][1:],
                       ["d/weights", "d/biases"])

  def testHeInitialiserScale(self):
    with tf.Graph().as_default() as graph, self.session(graph=graph):
      layers.conv2d(_images(), 256, 3, scope="c")
      self.evaluate(tf1.global_variables_initializer())
      kernel = self.evaluate(tf1.global_variables()[0])
      # Truncated normal with variance 2 / fan_in, fan_in = 3 * 3 * 3.
      self.assertNear(kernel.std(), np.sqrt(2. / 27.), 0.03)


if __name__ == "__main__":
  tf.test.main()
