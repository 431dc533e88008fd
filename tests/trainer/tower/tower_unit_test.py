"""--skip_unit=tower: a bad tower is left out, the others' average applied.

In-process: the trainer's own step (`train_step.build_step`) on four
virtual CPU devices, a tiny conv + batch-norm model, and the drill.
"""

from unittest import mock

import numpy as np
import tensorflow as tf

from tf1_safe_train.models import layers
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.recovery import state_rules
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

_BATCH = 2


def _model(images, is_training, num_classes):
  x = layers.conv2d(images, 2, 3, scope="conv")
  x = layers.batch_norm(x, is_training, "bn")
  x = tf.reshape(x, [-1, int(np.prod(x.shape[1:]))])
  return layers.dense(x, num_classes, "logits")


def _dataset(batch_size, unused_seed):
  rng = np.random.RandomState(7)
  images = rng.uniform(-1, 1, [64, 4, 4, 3]).astype(np.float32)
  labels = rng.randint(0, 10, [64]).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((images, labels)).batch(
      batch_size).repeat()


def params_for(**kwargs):
  defaults = dict(num_towers=4, device="cpu", batch_size=_BATCH,
                  optimizer="sgd", learning_rate=0.1, weight_decay=0.0,
                  skip_unit="tower")
  defaults.update(kwargs)
  return params_lib.TrainParams(**defaults).validate()


class Run(object):
  """The trainer's step in a session; `run()` runs one step."""

  def __init__(self, params):
    self.config = towers.TowerConfig(params.num_towers, "cpu")
    self.graph = tf.Graph()
    with self.graph.as_default():
      with mock.patch.object(train_step.models, "get_model",
                             lambda unused_name: _model):
        self.step = train_step.build_step(
            params, local_replication.Local(params, self.config),
            dataset_fn=_dataset)
      self.trainable = tf1.trainable_variables()
      self.statistics = [v for v in tf1.global_variables()
                         if "moving" in v.op.name]
      # Without Grappler, as the reference: its rewrites (which it may cut
      # short under load) can compute the applied average differently from
      # the fetched tower gradients, in the last bit, from run to run (a
      # clean-clone CI run failed so).
      session_config = towers.session_config(self.config)
      session_config.graph_options.rewrite_options.disable_meta_optimizer = (
          True)
      self.sess = tf1.Session(config=session_config)
      self.sess.run(tf1.global_variables_initializer())

  def state(self):
    return self.sess.run({"weights": self.trainable,
                          "statistics": self.statistics})

  def run(self, extra=None):
    step = self.step
    fetches = {"train": step.train_op, "applied": step.applied,
               "counters": step.counters, "totals": step.totals,
               "towers": step.report.tower_flags, "lr": step.learning_rate,
               "loss": step.loss}
    if step.loss_scale is not None:
      fetches["scale"] = step.loss_scale.scale
    fetches.update(extra or {})
    return self.sess.run(fetches)

  def close(self):
    self.sess.close()


def _reference(weights, variables, grads, learning_rate, config):
  """Weights after SGD on the average of `grads` (towers.average_gradients,
  the step-mode average, over the given towers only)."""
  with tf.Graph().as_default():
    made = [tf1.Variable(w, name=v.op.name) for w, v in zip(weights,
                                                            variables)]
    # Fed, not constants, which Grappler would fold in another order.
    fed = [[tf1.placeholder(tf.float32, g.shape) for g in tower]
           for tower in grads]
    averaged = towers.average_gradients(
        [list(zip(tower, made)) for tower in fed])
    apply = tf1.train.GradientDescentOptimizer(learning_rate).apply_gradients(
        averaged)
    # Without Grappler: on this small graph of fed gradients its rewrites
    # changed the last bit of a few elements, from run to run (the trainer
    # and this graph without them both equal numpy's, `_numpy_reference`).
    session_config = towers.session_config(config)
    session_config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf1.Session(config=session_config) as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(apply, dict(zip(sum(fed, []), sum(grads, []))))
      return sess.run(made)


def _numpy_reference(weights, grads, learning_rate):
  """The same in numpy: towers summed in order, times float32(1/n)."""
  scale = np.float32(1.0 / len(grads))
  out = []
  for k, w in enumerate(weights):
    total = grads[0][k]
    for tower in grads[1:]:
      total = total + tower[k]
    out.append(w - np.float32(learning_rate) * (total * scale))
  return out


def _bits(arrays):
  return [np.asarray(a).tobytes() for a in arrays]


class TowerUnitTest(tf.test.TestCase):

  def _run(self, **kwargs):
    run = Run(params_for(**kwargs))
    self.addCleanup(run.close)
    return run

  def testLeftOutTowerAppliesTheOthersAverageBitForBit(self):
    run = self._run(inject_nonfinite="nan@1:1")
    run.run()
    before = run.state()
    unit = run.step.tower_unit
    grads = [[g for g, _ in gv] for gv in unit.tower_grads_and_vars]
    out = run.run({"grads": grads})
    self.assertTrue(out["applied"])
    self.assertTrue(np.isnan(out["grads"][1][0]).any())
    self.assertEqual([False, True, False, False], list(out["towers"]))
    self.assertEqual([0, 1, 0, 0], list(out["totals"]["rejected_by_tower"]))
    self.assertEqual((2, 0), (out["counters"].applied_steps,
                              out["counters"].skipped_steps))
    self.assertTrue(np.isfinite(out["loss"]))
    variables = [v for _, v in unit.tower_grads_and_vars[0]]
    self.assertEqual([v.op.name for v in run.trainable],
                     [v.op.name for v in variables])
    expected = _reference(before["weights"], variables,
                          [out["grads"][t] for t in (0, 2, 3)], out["lr"],
                          run.config)
    after = run.state()
    self.assertEqual(_bits(expected), _bits(after["weights"]))
    self.assertEqual(_bits(_numpy_reference(
        before["weights"], [out["grads"][t] for t in (0, 2, 3)], out["lr"])),
                     _bits(after["weights"]))
    # Tower 0 was kept: its statistics moved.
    self.assertNotEqual(_bits(before["statistics"]),
                        _bits(after["statistics"]))

  def testEveryTowerBadSkipsTheStep(self):
    run = self._run(inject_nonfinite="nan@1:0,nan@1:1,nan@1:2,nan@1:3")
    run.run()
    before = run.state()
    out = run.run()
    self.assertFalse(out["applied"])
    self.assertEqual((1, 1), (out["counters"].applied_steps,
                              out["counters"].skipped_steps))
    self.assertEqual([0, 0, 0, 0], list(out["totals"]["rejected_by_tower"]))
    after = run.state()
    self.assertEqual(_bits(before["weights"]), _bits(after["weights"]))
    self.assertEqual(_bits(before["statistics"]), _bits(after["statistics"]))

  def testTowerZeroLeftOutRollsBackItsStatistics(self):
    run = self._run(inject_nonfinite="nan@1:0")
    run.run()
    before = run.state()
    out = run.run()
    self.assertTrue(out["applied"])
    self.assertEqual([1, 0, 0, 0], list(out["totals"]["rejected_by_tower"]))
    after = run.state()
    self.assertEqual(_bits(before["statistics"]), _bits(after["statistics"]))
    for b, a in zip(before["weights"], after["weights"]):
      self.assertTrue(np.isfinite(a).all())
    self.assertNotEqual(_bits(before["weights"]), _bits(after["weights"]))
    # And the next step keeps tower 0's statistics again.
    self.assertTrue(run.run()["applied"])
    self.assertNotEqual(_bits(after["statistics"]),
                        _bits(run.state()["statistics"]))

  def testFewerThanMinHealthySkipsTheStep(self):
    run = self._run(inject_nonfinite="nan@0:1,nan@0:2", min_healthy_towers=3)
    before = run.state()
    out = run.run()
    self.assertFalse(out["applied"])
    self.assertEqual(_bits(before["weights"]), _bits(run.state()["weights"]))

  def testHalfTheTowersHealthyIsEnoughByDefault(self):
    run = self._run(inject_nonfinite="nan@0:1,nan@0:2")
    out = run.run()
    self.assertTrue(out["applied"])
    self.assertEqual([0, 1, 1, 0], list(out["totals"]["rejected_by_tower"]))

  def testFp16OverflowInOneTowerHalvesTheScaleAndApplies(self):
    run = self._run(num_towers=2, precision="fp16", initial_loss_scale=1024.0,
                    inject_nonfinite="inf@0:1")
    out = run.run()
    self.assertTrue(out["applied"])
    self.assertEqual(512.0, out["scale"])
    self.assertEqual([0, 1], list(out["totals"]["rejected_by_tower"]))
    out = run.run()  # Both healthy: kept (growth needs 2000 good steps).
    self.assertEqual((2, 512.0), (out["counters"].applied_steps, out["scale"]))

  def testStepModeSkipsTheWholeStep(self):
    run = self._run(skip_unit="step", inject_nonfinite="nan@0:1")
    out = run.run()
    self.assertFalse(out["applied"])
    self.assertIsNone(run.step.tower_unit)
    self.assertNotIn("rejected_by_tower", out["totals"])


class OutlierTowerTest(tf.test.TestCase):
  """--skip_tower_outliers with the tower unit: a finite outlier tower is
  left out like a NaN one; 2 towers that disagree skip the step."""

  _S = 12  # The faulty step: after the tests' warm-up of 10 applied steps.

  def _run(self, **kwargs):
    values = dict(skip_tower_outliers=6.0,
                  skip_tower_outliers_warmup_steps=10, batch_size=8)
    values.update(kwargs)
    run = Run(params_for(**values))
    self.addCleanup(run.close)
    return run

  def _step_s(self, run):
    """Runs up to step S; returns (weights before S, its fetches)."""
    for _ in range(self._S):
      self.assertTrue(run.run()["applied"])
    before = run.state()
    unit = run.step.tower_unit
    return before, run.run({"grads": [[g for g, _ in gv] for gv in
                                      unit.tower_grads_and_vars]})

  def _average_of(self, run, before, out, towers_kept):
    return _numpy_reference(before["weights"],
                            [out["grads"][t] for t in towers_kept], out["lr"])

  def testAScale10TowerIsLeftOutAndTheOthersAverageApplied(self):
    run = self._run(inject_nonfinite="scale10@%d:2" % self._S)
    before, out = self._step_s(run)
    self.assertTrue(out["applied"])
    self.assertEqual([0, 0, 1, 0], list(out["totals"]["rejected_by_tower"]))
    self.assertEqual([0, 0, 1, 0],
                     list(out["totals"]["tower_outlier_by_tower"]))
    # Not a NaN: no non-finite count.
    self.assertEqual([0, 0, 0, 0],
                     list(out["totals"]["nonfinite_steps_by_tower"]))
    after = run.state()
    self.assertEqual(_bits(self._average_of(run, before, out, (0, 1, 3))),
                     _bits(after["weights"]))
    self.assertNotEqual(
        _bits(self._average_of(run, before, out, (0, 1, 2, 3))),
        _bits(after["weights"]))
    # And the next steps apply every tower again.
    out = run.run()
    self.assertEqual([0, 0, 1, 0], list(out["totals"]["rejected_by_tower"]))

  def testAnExponentBitFlipIsCaught(self):
    # bitflip30: the top exponent bit of tower 2's largest gradient element
    # (a finite value about 2**128 times larger): the tower is left out
    # and the other three's average applied.
    run = self._run(inject_nonfinite="bitflip30@%d:2" % self._S)
    before, out = self._step_s(run)
    self.assertTrue(out["applied"])
    self.assertTrue(np.isfinite(np.concatenate(
        [np.ravel(g) for g in out["grads"][2]])).all())
    self.assertEqual([0, 0, 1, 0], list(out["totals"]["rejected_by_tower"]))
    self.assertEqual([0, 0, 0, 0],
                     list(out["totals"]["nonfinite_steps_by_tower"]))
    self.assertEqual(_bits(self._average_of(run, before, out, (0, 1, 3))),
                     _bits(run.state()["weights"]))

  def testWithThreeTowersOnlyTheScaledOneIsLeftOut(self):
    # Regression: the median of the other two towers is their mean, which
    # the 10x tower drags up, so a healthy tower's ratio to it strayed too
    # (tower 0 named as well: two of three left out, the step skipped).
    run = self._run(num_towers=3, inject_nonfinite="scale10@%d:2" % self._S)
    before, out = self._step_s(run)
    self.assertTrue(out["applied"])
    self.assertEqual([0, 0, 1], list(out["totals"]["rejected_by_tower"]))
    self.assertEqual([0, 0, 1],
                     list(out["totals"]["tower_outlier_by_tower"]))
    self.assertEqual(_bits(self._average_of(run, before, out, (0, 1))),
                     _bits(run.state()["weights"]))

  def testWithoutTheCriterionTheSameRunAppliesAllFour(self):
    run = self._run(skip_tower_outliers=0.0,
                    inject_nonfinite="scale10@%d:2" % self._S)
    before, out = self._step_s(run)
    self.assertTrue(out["applied"])
    self.assertEqual([0, 0, 0, 0], list(out["totals"]["rejected_by_tower"]))
    self.assertNotIn("tower_outlier_by_tower", out["totals"])
    after = run.state()
    self.assertEqual(
        _bits(self._average_of(run, before, out, (0, 1, 2, 3))),
        _bits(after["weights"]))
    self.assertNotEqual(_bits(self._average_of(run, before, out, (0, 1, 3))),
                        _bits(after["weights"]))

  def testACleanRunLeavesNothingOut(self):
    run = self._run(seed=3)
    for _ in range(300):
      out = run.run()
      self.assertTrue(out["applied"])
    self.assertEqual([0, 0, 0, 0], list(out["totals"]["rejected_by_tower"]))
    self.assertEqual([0, 0, 0, 0],
                     list(out["totals"]["tower_outlier_by_tower"]))

  def testTwoTowersThatDisagreeSkipTheStep(self):
    # Which of the two is wrong cannot be told: their ratio's history
    # says they disagree, and the whole step is skipped.
    run = self._run(num_towers=2, inject_nonfinite="scale10@%d:1" % self._S)
    before, out = self._step_s(run)
    self.assertFalse(out["applied"])
    self.assertEqual((self._S, 1), (out["counters"].applied_steps,
                                    out["counters"].skipped_steps))
    self.assertEqual(1, out["totals"]["skip_reasons"]["tower_outlier_skips"])
    self.assertEqual([0, 0], list(out["totals"]["rejected_by_tower"]))
    self.assertEqual(_bits(before["weights"]), _bits(run.state()["weights"]))
    self.assertTrue(run.run()["applied"])

  def testItsCountIsHistoryKeptOnRollback(self):
    run = self._run()
    with run.graph.as_default():
      names = [v.op.name for v in state_rules.kept_on_rollback()]
      model_state = [v.op.name for v in tf1.global_variables()
                     if v.op.name.startswith("tower_outlier_history/")]
    self.assertIn("tower_outlier_by_tower", names)
    # Its statistics are the model's: restored with it.
    self.assertLen(model_state, 3)
    self.assertEqual([], [n for n in model_state if n in names])


if __name__ == "__main__":
  tf.test.main()
