"""The trainer's skip report and what its good steps execute.

The decision checks the averaged gradients only; each tower adds one fused
flag. The report must still name the towers and variables of a fault, and a
good step's executed nodes must not grow per tower with the variables.
"""

import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from bench import cost_growth_variants
from bench import executed_ops
from tf1_safe_train.core import hooks
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

_BIG = 3e38  # Finite in float32; the sum of two overflows to Inf.
_INF, _NAN = float("inf"), float("nan")


def _gradient_model(values):
  """A model whose gradients are set per tower by the tensor `values`.

  `values[i]` is (dense, sparse): tower i's gradient of the dense variable
  `model/w` is `dense` everywhere, and the gathered rows of the embedding
  `model/emb` (an `IndexedSlices` gradient, rows 0 and 1) get `sparse`. A
  tensor (fed per run), so one graph serves every case of a tower count.
  """

  def model_fn(images, is_training, num_classes):
    del is_training
    scope = tf1.get_default_graph().get_name_scope()
    tower = int(re.match(r"tower_(\d+)", scope).group(1))
    dense, sparse = values[tower, 0], values[tower, 1]

    def fixed(value):
      @tf.custom_gradient
      def through(x):
        return tf.identity(x), lambda dy: tf.fill(tf.shape(x), value)
      return through

    with tf1.variable_scope("model", reuse=tf1.AUTO_REUSE):
      w = tf1.get_variable("w", [4], initializer=tf1.zeros_initializer())
      emb = tf1.get_variable("emb", [3, 2],
                             initializer=tf1.zeros_initializer())
    used = (tf.reduce_sum(fixed(dense)(w.read_value())) +
            tf.reduce_sum(fixed(sparse)(tf.gather(emb, [0, 1]))))
    batch = tf.shape(images)[0]
    return tf.zeros([batch, num_classes]) + 0.0 * used

  return model_fn


def _dataset(unused_batch_size, unused_seed):
  images = np.zeros([2, 4, 4, 3], np.float32)
  labels = np.zeros([2], np.int32)
  return tf.data.Dataset.from_tensors((images, labels)).repeat()


class _Trainer(object):
  """The trainer's step for one tower count, built once, in its session."""

  def __init__(self, num_towers):
    params = params_lib.TrainParams(
        num_towers=num_towers, device="cpu", batch_size=2, optimizer="sgd",
        weight_decay=0.0).validate()
    config = towers.TowerConfig(num_towers, "cpu")
    with tf.Graph().as_default() as graph:
      self.values = tf1.placeholder(tf.float32, [num_towers, 2])
      with mock.patch.object(train_step.models, "get_model",
                             lambda unused_name: _gradient_model(
                                 self.values)):
        step = train_step.build_step(
            params, local_replication.Local(params, config),
            dataset_fn=_dataset)
      self.report = step.report
      self.fetches = {"step": step.step_index, "applied": step.applied,
                      "towers": self.report.tower_flags,
                      "average": self.report.average_flags,
                      "train": step.train_op}
      self.init = tf1.global_variables_initializer()
    graph.finalize()
    self.session = tf1.Session(graph=graph,
                               config=towers.session_config(config))

  def skip_report(self, values):
    # Every case starts from fresh variables (step 0), as a new graph did.
    self.session.run(self.init)
    out = self.session.run(self.fetches, {self.values: values})
    if out["applied"]:
      return None
    return hooks.describe_skip(out["step"], out["towers"], out["average"],
                               self.report.variable_names,
                               self.report.tower_devices)


_TRAINERS = {}


def _skip_report(values):
  """Runs one step of the trainer; returns its skip report line or None."""
  if len(values) not in _TRAINERS:
    _TRAINERS[len(values)] = _Trainer(len(values))
  return _TRAINERS[len(values)].skip_report(values)


class SkipReportTest(parameterized.TestCase):

  @classmethod
  def tearDownClass(cls):
    for trainer in _TRAINERS.values():
      trainer.session.close()
    _TRAINERS.clear()
    super().tearDownClass()

  def testGoodStepHasNoReport(self):
    self.assertIsNone(_skip_report([(1.0, 1.0), (2.0, 2.0)]))

  @parameterized.parameters(0, 1, 2)
  def testNamesTheTowerAndVariable(self, bad):
    values = [(1.0, 1.0)] * 3
    values[bad] = (_NAN, 1.0)
    self.assertEqual(
        _skip_report(values),
        "skipped step 0: non-finite gradients in tower %d (/device:CPU:%d); "
        "variables: model/w" % (bad, bad))

  def testNamesEveryBadTowerAndVariable(self):
    self.assertEqual(
        _skip_report([(_INF, 1.0), (1.0, 1.0), (1.0, -_INF)]),
        "skipped step 0: non-finite gradients in towers 0 (/device:CPU:0), "
        "2 (/device:CPU:2); variables: model/w, model/emb")

  def testFiniteValuesWhoseSumOverflows(self):
    self.assertEqual(
        _skip_report([(_BIG, 1.0), (_BIG, 1.0)]),
        "skipped step 0: non-finite gradients in the averaged gradients "
        "(every tower was finite: overflow); variables: model/w")

  def testSparseInfPairAveragesToNaN(self):
    self.assertEqual(
        _skip_report([(1.0, _INF), (1.0, -_INF)]),
        "skipped step 0: non-finite gradients in towers 0 (/device:CPU:0), "
        "1 (/device:CPU:1); variables: model/emb")

  def testSparseGradientInOneTower(self):
    self.assertEqual(
        _skip_report([(1.0, 1.0), (1.0, _NAN)]),
        "skipped step 0: non-finite gradients in tower 1 (/device:CPU:1); "
        "variables: model/emb")

  def testDenseInfPairAveragesToNaN(self):
    self.assertEqual(
        _skip_report([(-_INF, 1.0), (_INF, 1.0)]),
        "skipped step 0: non-finite gradients in towers 0 (/device:CPU:0), "
        "1 (/device:CPU:1); variables: model/w")

  def testOneTower(self):
    self.assertEqual(
        _skip_report([(_NAN, 1.0)]),
        "skipped step 0: non-finite gradients in tower 0 (/device:CPU:0); "
        "variables: model/w")


def _guard_nodes(workload, num_towers):
  """Executed nodes of the trainer's good step minus plain's, same towers."""
  counts = {}
  for variant in ("plain", "guarded_trainer_step"):
    built = cost_growth_variants.build(variant, workload, num_towers)
    with built.session:
      built.session.run(built.train_op)  # The first run also initialises.
      counts[variant] = executed_ops.executed_nodes(built.session,
                                                    built.train_op)
      assert built.all_steps_applied() is not False, "a step was skipped"
  return counts["guarded_trainer_step"] - counts["plain"]


class StepResultTest(absltest.TestCase):

  def testTheStepGetsItsResultAsAReturnValue(self):
    # Issue 34, 3: the step takes its decision's result from what the
    # strategy's `decide` returns, not from the wrapper's stored last
    # result (`guard_result()`, which the public API keeps for scripts).
    params = params_lib.TrainParams(
        num_towers=2, device="cpu", batch_size=2, optimizer="sgd",
        weight_decay=0.0).validate()
    config = towers.TowerConfig(2, "cpu")
    with tf.Graph().as_default():
      values = tf1.placeholder(tf.float32, [2, 2])
      with mock.patch.object(train_step.models, "get_model",
                             lambda unused_name: _gradient_model(values)), \
          mock.patch.object(optimizer_lib.SkipNonFiniteOptimizer,
                            "guard_result", side_effect=AssertionError(
                                "read through guard_result()")):
        step = train_step.build_step(
            params, local_replication.Local(params, config),
            dataset_fn=_dataset)
      self.assertIsNotNone(step.reasons)
      self.assertIn("skip_reasons", step.totals)


class GoodStepCostTest(absltest.TestCase):

  def testGuardNodesDoNotGrowPerTowerWithVariables(self):
    # 6 variables (40 before, at 4x the time) give the same counts (26
    # nodes per tower beyond the second, 33 for the second): one node per
    # variable and tower would add 6 per tower, past the 4 nodes of
    # headroom under the first bound below.
    variables = 6
    workload = "dense%d" % variables
    extra = {t: _guard_nodes(workload, t) for t in (1, 2, 4)}
    # Each tower beyond the first adds its fused flag: a few nodes per group
    # of same-shaped gradients (here two: weights and biases), and the cond
    # its input is read in (8 nodes: a replay never runs the iterator),
    # never a check chain per gradient (~10 nodes per variable and tower
    # before).
    self.assertLessEqual((extra[4] - extra[2]) / 2.0, 30, extra)
    # The second tower also adds the stacking of the flags.
    self.assertLessEqual(extra[2] - extra[1], 30 + 15, extra)

if __name__ == "__main__":
  absltest.main()
