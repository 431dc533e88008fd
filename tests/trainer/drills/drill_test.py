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


def _tower_grads(num_towers, drill, step):
  """Each tower's (clean placeholders, faulted gradients) under `drill`."""
  v = tf1.get_variable("v", initializer=[0.0, 0.0, 0.0])
  w = tf1.get_variable("w", initializer=[0.0, 0.0])
  towers = []
  for i in range(num_towers):
    clean = [tf1.placeholder(tf.float32, [3]), tf1.placeholder(tf.float32, [2])]
    pairs = drill.tower(step, i).grads([(None, w), (clean[0], v),
                                        (clean[1], w)])
    towers.append((clean, [g for g, _ in pairs[1:]]))
  return towers


def _gradients(step, tower):
  """Gradients that change every step (a stale one differs)."""
  base = float(1 + step + 10 * tower)
  return [np.array([0.5, -base, 0.25], np.float32),
          np.array([base / 3, 1.0], np.float32)]


class FiniteDrillTest(tf.test.TestCase):

  def testGraphAgreesWithTheTwinOnEveryStepAndTower(self):
    spec = "bitflip27@2-30~5:1,stale%0.3,scale3@4-~6:1,bitflip31%0.2"
    drill = drill_lib.Drill(spec, "grads", num_towers=3, seed=4)
    with tf.Graph().as_default():
      step = tf1.placeholder(tf.int64, [])
      towers = _tower_grads(3, drill, step)
      with self.cached_session() as sess:
        sess.run(tf1.local_variables_initializer())
        previous = None
        for s in range(40):
          feed = {step: s}
          for i, (clean, _) in enumerate(towers):
            feed.update(zip(clean, _gradients(s, i)))
          got = sess.run([f for _, f in towers], feed)
          for i in range(3):
            want = _expected(drill.rules, s, i, previous)
            for g, e in zip(got[i], want):
              self.assertAllEqual(e.view(np.uint32), g.view(np.uint32))
          previous = s

  def testStaleGivesEveryGradientOfThePreviousStep(self):
    drill = drill_lib.Drill("stale@3-4:1", "grads", num_towers=2)
    with tf.Graph().as_default():
      step = tf1.placeholder(tf.int64, [])
      towers = _tower_grads(2, drill, step)
      with self.cached_session() as sess:
        sess.run(tf1.local_variables_initializer())
        for s in range(6):
          feed = {step: s}
          for i, (clean, _) in enumerate(towers):
            feed.update(zip(clean, _gradients(s, i)))
          got = sess.run(towers[1][1], feed)
          want = _gradients(s - 1 if s in (3, 4) else s, 1)
          for g, e in zip(got, want):
            self.assertAllEqual(e, g)
          # Tower 0 has no rule: its gradients are the placeholders.
          self.assertIs(towers[0][0][0], towers[0][1][0])

  def testReplayFeedsTurnFiniteFaultsOff(self):
    drill = drill_lib.Drill("bitflip30@0-,stale@0-,scale10@0-", "grads")
    with tf.Graph().as_default():
      step = tf.constant(5, tf.int64)
      tower = drill.tower(step, 0)
      clean = tf.constant([1.0, -2.0])
      faulted = tower.grads([(clean, None)])[0][0]
      with self.cached_session() as sess:
        sess.run(tf1.local_variables_initializer())
        self.assertAllEqual([1.0, -2.0],
                            sess.run(faulted, tower.in_step_faults()))
        # Active: stale (the replayed run's gradient: a replay writes the
        # buffer too), scaled, flipped.
        want = injection.flip_bit_numpy(np.float32([10.0, -20.0]), 30)[0]
        self.assertAllEqual(want, sess.run(faulted))

  def testListsCleanAndFaultedGradientsOnlyForFiniteGradientDrills(self):
    for spec, target, listed in (("bitflip22@1:1", "grads", 4),
                                 ("scale2@1", "loss", 0), ("nan@1", "grads",
                                                           0)):
      with tf.Graph().as_default():
        towers = _tower_grads(2, drill_lib.Drill(spec, target, 2),
                              tf.constant(0, tf.int64))
        clean = tf1.get_collection(drill_lib.CLEAN_GRADIENTS)
        faulted = tf1.get_collection(drill_lib.FAULTED_GRADIENTS)
        self.assertLen(clean, listed)
        if listed:
          self.assertEqual(towers[0][0] + towers[1][0], clean)
          self.assertEqual(towers[0][1] + towers[1][1], faulted)

  def testGradientOnlyKindsRefuseOtherTargets(self):
    with self.assertRaisesRegex(injection.InjectionSpecError,
                                "needs --inject_into=grads, not loss"):
      drill_lib.Drill("bitflip30@1", "loss")


def _expected(rules, step, tower, previous):
  """The twin: tower's gradients at `step` as the drill should fault them."""
  fired = {injection.group(r): r for r in reversed(
      injection.active_rules(rules, step, tower, seed=4))}
  grads = _gradients(step, tower)
  if "stale" in fired:
    grads = (_gradients(previous, tower) if previous is not None else
             [np.zeros_like(g) for g in grads])
  if "scale" in fired:
    grads = [g * np.float32(fired["scale"].value) for g in grads]
  if "bitflip" in fired:
    grads[0] = injection.flip_bit_numpy(grads[0], int(fired["bitflip"].value))[0]
  return grads


if __name__ == "__main__":
  tf.test.main()
