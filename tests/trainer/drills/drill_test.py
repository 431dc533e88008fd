"""Tests of drill: the spec parsed once, poison points no-ops unless targeted."""

import numpy as np
import tensorflow as tf

from tf1_safe_train.trainer.drills import drill as drill_lib
from tf1_safe_train.trainer.drills import injection

tf1 = tf.compat.v1


class DrillTest(tf.test.TestCase):

  def testValidatesOnce(self):
    with self.assertRaisesRegex(injection.InjectionSpecError,
                                "TOWER 2 out of range, there are 2"):
      drill_lib.Drill("nan@1:2", "grads", num_towers=2)
    with self.assertRaisesRegex(ValueError, "inject_into must be one of"):
      drill_lib.Drill("nan@1", "weights")

  def testUntargetedPointsAddNoOp(self):
    with tf.Graph().as_default() as graph:
      step = tf.constant(1, tf.int64)
      x = tf.constant([1.0, 2.0])
      v = tf1.get_variable("v", initializer=[0.0, 0.0])
      before = len(graph.get_operations())
      # A rule for tower 1 only: tower 0's points are the identity.
      tower0 = drill_lib.Drill("nan@1:1", "loss", num_towers=2).tower(step, 0)
      self.assertIs(tower0.input(x), x)
      self.assertIs(tower0.loss(x), x)
      self.assertIs(tower0.grads([(x, v)])[0][0], x)
      self.assertLen(graph.get_operations(), before)
      # Tower 1 is targeted at its loss only.
      tower1 = drill_lib.Drill("nan@1:1", "loss", num_towers=2).tower(step, 1)
      self.assertIs(tower1.input(x), x)
      self.assertIs(tower1.grads([(x, v)])[0][0], x)
      self.assertTrue(np.isnan(self.evaluate(tower1.loss(x))).all())

  def testPoisonsTheFirstGradient(self):
    with tf.Graph().as_default():
      step = tf.constant(3, tf.int64)
      v = tf1.get_variable("v", initializer=[0.0])
      w = tf1.get_variable("w", initializer=[0.0])
      tower = drill_lib.Drill("inf@3", "grads").tower(step, 0)
      pairs = tower.grads([(None, v), (tf.constant([1.0]), w),
                           (tf.constant([2.0]), w)])
      self.assertIsNone(pairs[0][0])
      self.assertAllEqual(self.evaluate(pairs[1][0]), [np.inf])
      self.assertAllEqual(self.evaluate(pairs[2][0]), [2.0])

  def testScaleMultipliesEveryGradientOfTheTowerOnItsSteps(self):
    with tf.Graph().as_default():
      v = tf1.get_variable("v", initializer=[0.0])
      w = tf1.get_variable("w", initializer=[0.0, 0.0])
      drill = drill_lib.Drill("scale1e3@3,nan@4", "grads")
      for step, expected in ((2, [1.0, 2.0, 3.0]), (3, [1e3, 2e3, 3e3]),
                             (4, [np.nan, 2.0, 3.0])):
        tower = drill.tower(tf.constant(step, tf.int64), 0)
        pairs = tower.grads([(None, v), (tf.constant([1.0]), v),
                             (tf.constant([2.0, 3.0]), w)])
        self.assertIsNone(pairs[0][0])
        got = np.concatenate(self.evaluate([pairs[1][0], pairs[2][0]]))
        self.assertAllClose(got, expected)
        loss = drill_lib.Drill("scale1e3@3", "loss").tower(
            tf.constant(step, tf.int64), 0).loss(tf.constant(2.0))
        self.assertAllClose(self.evaluate(loss), 2e3 if step == 3 else 2.0)


if __name__ == "__main__":
  tf.test.main()
