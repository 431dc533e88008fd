"""A sync-replica worker's own view of its step (`replica_view`).

What a worker's step reports fetch every step (`applied` and the
per-variable flags) costs a fused check on good steps, not one check chain
per gradient (issue 16); a skip still names exactly the variables whose
gradients held a NaN or an Inf on this worker.
"""

from absl.testing import parameterized
import numpy as np
from tests.fixtures import tiny_model as test_util
import tensorflow as tf

from bench import executed_ops
from tf1_safe_train.cluster import sync_replicas

tf1 = tf.compat.v1

_NAN, _INF = float("nan"), float("inf")


class _Step(object):
  """A worker's pushed gradients and its view, in a graph of its own.

  Gradient i is dense, of shape [1, i + 1] (every shape different, the most
  checks a fused check needs), cut by one `Split` from the fed `source`, so
  producing them costs the same few nodes however many there are. With
  `sparse`, an `IndexedSlices` (rows 0 and 2 of a [3, 2] variable, fed by
  `rows`) and a None gradient come first. With `one_tower`, the tower
  flags are a one-tower worker's (`train_step`'s constant False) and the
  step keeps a value in a cond on `applied`, as its batch store does.
  """

  def __init__(self, num_dense, sparse=False, control_flow_v2=True,
               one_tower=False):
    self.graph = tf.Graph()
    with self.graph.as_default(), test_util.tf_config(control_flow_v2):
      sizes = [i + 1 for i in range(num_dense)]
      self.source = tf1.placeholder(tf.float32, [1, sum(sizes)])
      self.towers = (tf.zeros([1], tf.bool) if one_tower else
                     tf1.placeholder_with_default([False, False], [2]))
      pairs = []
      if sparse:
        self.rows = tf1.placeholder(tf.float32, [2, 2])
        emb = tf1.get_variable("emb", [3, 2])
        pairs.append((tf.IndexedSlices(self.rows, tf.constant([0, 2]),
                                       tf.constant([3, 2])), emb))
        pairs.append((None, tf1.get_variable("unused", [1])))
      grads = tf.split(self.source, sizes, axis=1)
      for i, grad in enumerate(grads):
        pairs.append((grad, tf1.get_variable("w%d" % i, [1, sizes[i]])))
      self.produce = tf.group(*grads)
      global_step = tf1.train.get_or_create_global_step()
      optimizer = sync_replicas.sync_optimizer(
          tf1.train.GradientDescentOptimizer(0.1), num_workers=1)
      optimizer.apply_gradients(pairs, global_step=global_step)
      self.view = sync_replicas.replica_view(optimizer, pairs, self.towers)
      # What the step reports fetch of the view.
      self.fetches = [self.view.applied, self.view.nonfinite_flags]
      if one_tower:
        kept = tf1.Variable(0, name="kept")
        self.fetches.append(tf.cond(
            self.view.applied, lambda: tf1.assign_add(kept, 1).op,
            tf.no_op, name="keep_applied_batch"))
      init = tf1.global_variables_initializer()
    self.sizes = sizes
    self.session = tf1.Session(graph=self.graph)
    self.session.run(init)

  def feed(self, dense=None, rows=None, towers=None):
    """Every gradient 1.0, but gradient k of `dense` = (k, value)."""
    source = np.ones([1, sum(self.sizes)], np.float32)
    if dense is not None:
      k, value = dense
      source[0, sum(self.sizes[:k]) + k] = value  # Gradient k's last element.
    feed = {self.source: source}
    if hasattr(self, "rows"):
      feed[self.rows] = np.ones([2, 2], np.float32) if rows is None else rows
    if towers is not None:
      feed[self.towers] = towers
    return feed

  def run(self, **kwargs):
    return self.session.run(self.fetches, self.feed(**kwargs))[:2]

  def extra_executed(self):
    """Nodes a good step's view fetches execute beyond producing the
    gradients, per op type (the session has run both once: no one-off
    initialisation)."""
    feed = self.feed()
    self.session.run([self.fetches, self.produce], feed)
    counts = executed_ops.executed_op_types(
        executed_ops.trace_run(self.session, self.fetches, feed))
    counts.subtract(executed_ops.executed_op_types(
        executed_ops.trace_run(self.session, self.produce, feed)))
    return counts


class GoodStepCostTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.parameters(True, False)
  def testGoodStepPaysForAFusedCheckOnly(self, control_flow_v2):
    # Before issue 16 a sync worker's view checked each gradient with its own
    # chain (IsFinite, All, LogicalNot): 3 nodes, 3 kernels per gradient.
    # Now one fused check (a Reshape per tensor of its own shape: no kernel
    # on a GPU) and the flags' cond (a Switch per gradient, which forwards
    # it); the per-gradient checks run on a skip only.
    extra = {}
    for n in (10, 40):
      step = _Step(n, control_flow_v2=control_flow_v2)
      extra[n] = step.extra_executed()
      applied, flags = step.run()
      self.assertTrue(applied)
      self.assertAllEqual(flags, [False] * n)
    totals = {n: sum(c.values()) for n, c in extra.items()}
    self.assertLessEqual((totals[40] - totals[10]) / 30.0, 2.0, totals)
    for op_type in ("IsFinite", "All", "LogicalNot"):
      self.assertEqual(extra[10][op_type], extra[40][op_type], op_type)


class SkipAttributionTest(tf.test.TestCase, parameterized.TestCase):

  control_flow_v2 = True

  @classmethod
  def setUpClass(cls):
    super(SkipAttributionTest, cls).setUpClass()
    cls.step = _Step(6, sparse=True, control_flow_v2=cls.control_flow_v2)
    # The flags skip the None gradient: emb, then w0..w5.
    cls.names = ["emb"] + ["w%d" % i for i in range(6)]

  def testNamesAlignWithTheFlags(self):
    self.assertEqual(self.step.view.variable_names, self.names)
    self.assertEqual(self.step.view.nonfinite_flags.shape.as_list(),
                     [len(self.names)])

  def testAllFiniteIsApplied(self):
    applied, flags = self.step.run()
    self.assertTrue(applied)
    self.assertFalse(flags.any())

  @parameterized.parameters((0, _NAN), (3, _INF), (5, -_INF), (2, _NAN))
  def testNonFiniteGradientNamesExactlyItsVariable(self, k, value):
    applied, flags = self.step.run(dense=(k, value))
    self.assertFalse(applied)
    expected = np.zeros(len(self.names), bool)
    expected[1 + k] = True
    self.assertAllEqual(flags, expected)

  def testNonFiniteSparseGradientNamesItsVariable(self):
    applied, flags = self.step.run(
        rows=np.array([[1.0, 1.0], [_NAN, 1.0]], np.float32))
    self.assertFalse(applied)
    self.assertAllEqual(flags, [True] + [False] * 6)

  def testTwoBadGradientsAreBothNamed(self):
    step = self.step
    rows = np.array([[_INF, 1.0], [1.0, 1.0]], np.float32)
    applied, flags = step.run(dense=(4, _NAN), rows=rows)
    self.assertFalse(applied)
    self.assertAllEqual(flags, [True, False, False, False, False, True, False])

  def testTowerFlagAloneSkipsAndNamesNoVariable(self):
    # E.g. a tower's statistics delta was NaN, which the tower flags carry.
    applied, flags = self.step.run(towers=[False, True])
    self.assertFalse(applied)
    self.assertFalse(flags.any())


class OneTowerWorkerTest(tf.test.TestCase, parameterized.TestCase):
  """A one-tower worker's view, as its step fetches it (default Grappler).

  Its tower flags are a constant False. `or(False, any_bad)` was folded
  into an Identity, and the involution removal of `not(not(x))` through it
  gave the cond on `applied` the right value but the fetched `applied` its
  negation: every good step reported as a skip, a NaN step as applied
  (TF 2.21).
  """

  @parameterized.parameters(True, False)
  def testGoodStepIsAppliedAndNaNIsNot(self, control_flow_v2):
    step = _Step(3, control_flow_v2=control_flow_v2, one_tower=True)
    applied, flags = step.run()
    self.assertTrue(applied)
    self.assertAllEqual(flags, [False, False, False])
    applied, flags = step.run(dense=(1, _NAN))
    self.assertFalse(applied)
    self.assertAllEqual(flags, [False, True, False])


class SkipAttributionCondV1Test(SkipAttributionTest):
  """The same with v1 conds (`disable_v2_behavior`'s, legacy code's)."""

  control_flow_v2 = False


if __name__ == "__main__":
  tf.test.main()
