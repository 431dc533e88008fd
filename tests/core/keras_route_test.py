"""Keras 2 in graph mode: `compile(optimizer=SkipNonFiniteOptimizer(...))`.

A tiny model with BatchNormalization, trained by `train_on_batch` and `fit`
on a batch that holds a NaN: the weights, the optimizer's slots and the
moving statistics (Keras' own updates, not in `UPDATE_OPS`) are bit-identical
across the skip, and the counters count it. Keras in eager mode, which a
graph-mode step cannot take, is refused in one line.
"""

import os

# Before TensorFlow loads: Keras 2 (tf-keras), whose graph mode compiles a
# tf.compat.v1 optimizer, is used by TF 2.16+ only if this is set.
os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_keras  # pylint: disable=g-import-not-at-top,wrong-import-position

from tests.fixtures import tiny_model as test_util  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf1_safe_train.core import counters as counters_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf1_safe_train.core import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

tf1 = tf.compat.v1

# Eight examples, two per batch; the second batch holds a NaN.
_X = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape([8, 3])
_Y = np.linspace(0.5, -0.5, 8, dtype=np.float32).reshape([8, 1])
_NAN_X = _X.copy()
_NAN_X[2, 1] = np.nan


def _model():
  tf1.set_random_seed(1)
  return tf_keras.Sequential([
      tf_keras.layers.Dense(4, input_shape=(3,)),
      tf_keras.layers.BatchNormalization(),
      tf_keras.layers.Dense(1)])


def _compiled(model, optimizer=None, **kwargs):
  opt = optimizer_lib.SkipNonFiniteOptimizer(
      optimizer or tf1.train.MomentumOptimizer(0.1, momentum=0.9), **kwargs)
  model.compile(optimizer=opt, loss="mse")  # The one line.
  return opt


def _session():
  return tf1.keras.backend.get_session()


def _state(model, opt):
  """Weights (with the moving statistics) and slots, by name."""
  variables = list(model.weights) + opt.wrapped_optimizer.variables()
  return dict(zip([v.op.name for v in variables],
                  _session().run(variables)))


def _counters():
  return _session().run(list(counters_lib.skip_counters()))


class KerasGraphModeTest(tf.test.TestCase):

  def assertStateEqual(self, before, after):
    self.assertEqual(sorted(before), sorted(after))
    for name, value in before.items():
      np.testing.assert_array_equal(value, after[name], err_msg=name)

  def testTrainOnBatchSkipsNanBatch(self):
    # (Keras makes resource variables either way.)
    for name, config in [("CondV2", {}),
                         ("CondV1", {"control_flow_v2": False})]:
      with self.subTest(name), test_util.tf_config(**config):
        self._checkTrainOnBatchSkipsNanBatch()

  def _checkTrainOnBatchSkipsNanBatch(self):
    with tf.Graph().as_default():
      model = _model()
      opt = _compiled(model)
      model.train_on_batch(_X[:2], _Y[:2])
      before = _state(model, opt)
      self.assertTrue(any(name.endswith("moving_mean") for name in before))
      self.assertTrue(any(name.endswith("Momentum") for name in before))
      loss = model.train_on_batch(_NAN_X[2:4], _Y[2:4])
      self.assertTrue(np.isnan(loss))
      self.assertStateEqual(before, _state(model, opt))
      model.train_on_batch(_X[4:6], _Y[4:6])
      after = _state(model, opt)
      self.assertFalse(any(np.isnan(v).any() for v in after.values()))
      self.assertEqual(_counters(), [2, 1, 0])

  def testFitSkipsNanBatch(self):
    with tf.Graph().as_default():
      model = _model()
      opt = _compiled(model)
      states = []
      record = tf_keras.callbacks.LambdaCallback(
          on_batch_end=lambda batch, logs: states.append(_state(model, opt)))
      model.fit(_NAN_X, _Y, batch_size=2, epochs=1, shuffle=False,
                callbacks=[record], verbose=0)
      self.assertLen(states, 4)
      # Batch 1 held the NaN: nothing moved across it, the others trained.
      self.assertStateEqual(states[0], states[1])
      self.assertNotAllClose(states[1]["batch_normalization/moving_mean"],
                             states[2]["batch_normalization/moving_mean"])
      self.assertFalse(any(np.isnan(v).any() for v in states[3].values()))
      self.assertEqual(_counters(), [3, 1, 0])

  def testStatefulMetricsAreNotWritesOutsideTheDecision(self):
    # Keras groups its metrics' running totals next to the step; they count
    # what was fed (a skipped batch too, as documented), and no line could
    # protect them: the first-run check does not name them, so a strict
    # wrapper trains.
    with tf.Graph().as_default():
      model = _model()
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.MomentumOptimizer(0.1, momentum=0.9), strict=True)
      model.compile(optimizer=opt, loss="mse", metrics=["mae"])
      model.train_on_batch(_X[:2], _Y[:2])
      before = _state(model, opt)
      model.train_on_batch(_NAN_X[2:4], _Y[2:4])
      self.assertStateEqual(before, _state(model, opt))
      self.assertEqual(_counters(), [1, 1, 1])

  def testVariablesHoldTheWrappersOwn(self):
    # What Keras initializes: the counters, the statistics' shadows and the
    # loss scale too.
    with tf.Graph().as_default():
      model = _model()
      opt = _compiled(model, tf1.train.AdamOptimizer(0.01),
                      loss_scale="dynamic")
      model.train_on_batch(_X[:2], _Y[:2])
      model.train_on_batch(_NAN_X[2:4], _Y[2:4])
      names = [v.op.name for v in opt.variables()]
      self.assertEqual(_counters(), [1, 1, 1])
    self.assertContainsSubset(["training/beta1_power", "applied_steps",
                               "skipped_steps", "consecutive_skips",
                               "loss_scale/scale"], names)
    self.assertTrue(any("skip_shadow" in n for n in names), names)

  def _linear(self):
    """Dense(1) under plain gradient descent at rate 0.1: each step's update
    is hand-computable (`_descent`)."""
    tf1.set_random_seed(1)
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(3,))])
    opt = _compiled(model, tf1.train.GradientDescentOptimizer(0.1))
    return model, opt

  def _descent(self, model, x, y, rate):
    """The Dense(1) weights after one mse descent step at `rate`."""
    w, b = _session().run(model.weights)
    error = x.dot(w) + b - y
    return (w - rate * 2.0 * x.T.dot(error) / len(x),
            b - rate * 2.0 * error.sum(0) / len(x))

  def assertStepRate(self, model, rate):
    """One clean batch moves the weights by exactly `rate`'s step."""
    expected = self._descent(model, _X[:2], _Y[:2], rate)
    model.train_on_batch(_X[:2], _Y[:2])
    for want, got in zip(expected, _session().run(model.weights)):
      self.assertAllClose(want, got, rtol=1e-5, atol=1e-7)

  def testLearningRateSchedulerSetsTheAppliedRate(self):
    # A Keras script told to pass a tf.compat.v1.train optimizer keeps its
    # own callback: epoch 0 at rate 0 (the weights cannot move), epoch 1 at
    # 0.05; the NaN batch of each epoch is still skipped.
    with tf.Graph().as_default():
      model, _ = self._linear()
      weights, rates = [], []
      record = tf_keras.callbacks.LambdaCallback(
          on_epoch_end=lambda epoch, logs: (
              weights.append(_session().run(model.weights)),
              rates.append(logs["lr"])))
      initial = _session().run(model.weights)
      schedule = tf_keras.callbacks.LearningRateScheduler(
          lambda epoch, lr: [0.0, 0.05][epoch])
      model.fit(_NAN_X, _Y, batch_size=2, epochs=2, shuffle=False,
                callbacks=[schedule, record], verbose=0)
      self.assertAllClose([0.0, 0.05], rates)
      for kept, was in zip(weights[0], initial):
        self.assertAllEqual(was, kept)  # rate 0 applied: nothing moved
      self.assertNotAllClose(weights[0][0], weights[1][0])
      self.assertEqual(_counters(), [6, 2, 0])
      self.assertStepRate(model, 0.05)

  def testReduceLROnPlateauSetsTheAppliedRate(self):
    # min_delta: no epoch improves enough, so each one halves the rate.
    with tf.Graph().as_default():
      model, _ = self._linear()
      reduce_lr = tf_keras.callbacks.ReduceLROnPlateau(
          monitor="loss", factor=0.5, patience=0, min_delta=1e9)
      model.fit(_NAN_X, _Y, batch_size=2, epochs=2, shuffle=False,
                callbacks=[reduce_lr], verbose=0)
      self.assertAllClose(
          0.025, tf_keras.backend.get_value(model.optimizer.lr))
      self.assertEqual(_counters(), [6, 2, 0])
      self.assertStepRate(model, 0.025)

  def testKerasOptimizerIsRefused(self):
    with self.assertRaisesRegex(TypeError, "not a Keras optimizer"):
      optimizer_lib.SkipNonFiniteOptimizer(tf_keras.optimizers.SGD(0.1))

  def testEagerKerasIsRefusedAtTheFirstBatch(self):
    self.assertTrue(tf.executing_eagerly())
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(3,))])
    _compiled(model)
    with self.assertRaisesRegex(ValueError, "disable_eager_execution"):
      model.train_on_batch(_X[:2], _Y[:2])


if __name__ == "__main__":
  tf.test.main()
