"""The tower-agreement criterion (`core/tower_outliers.py`) in the wrapper.

`SkipNonFiniteOptimizer(opt, skip_tower_outliers=K)` given each tower's
gradients (`tower_grads_and_vars=`) skips a step on which one tower's
gradient norm disagrees with the others' and names that tower: it applies
the average it is given and cannot leave one tower out of it.
"""

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import criteria
from tf1_safe_train.core import criterion_spec
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import tower_outliers

tf1 = tf.compat.v1

_S = 12  # The faulty step, after a warm-up of 10 applied steps.


def _config(sigma=6.0, **kwargs):
  return tower_outliers.TowerOutlierConfig(sigma, warmup_steps=10, **kwargs)


def _counter(dry_run=False):
  """The graph's tower_outlier_skips (or _would_skips) counter."""
  return criteria.reason_counter(tower_outliers.REASON, dry_run)


class _Towers(object):
  """`num_towers` towers on their CPU devices sharing a 3-vector `w`, each
  with the gradient noise * w (the noise fed: about 1 +- 10%), tower
  `bad`'s times the fed `scale`; the wrapper applies their average."""

  def __init__(self, num_towers, bad, **keywords):
    self.w = tf1.get_variable("w", initializer=tf.ones([3]))
    self.scale = tf1.placeholder_with_default(1.0, [])
    self.noise = tf1.placeholder(tf.float32, [num_towers, 3])
    self.towers = []
    for i in range(num_towers):
      with tf1.device("/cpu:%d" % i):
        grad = self.noise[i] * self.w
        if i == bad:
          grad = grad * self.scale
        self.towers.append([(grad, self.w)])
    average = [(tf.add_n([t[0][0] for t in self.towers]) / num_towers,
                self.w)]
    self.opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.GradientDescentOptimizer(0.01), **keywords)
    global_step = tf1.train.get_or_create_global_step()
    self.result = self.opt.apply_gradients_with_result(
        average, global_step, tower_grads_and_vars=self.towers)
    self.report = self.opt.report_fetches(self.result.train_op)
    self.num_towers = num_towers

  def run(self, sess, steps, scale_at=None):
    """Runs `steps` steps (the bad tower scaled by 10 at `scale_at`);
    returns each step's (applied, line)."""
    rng = np.random.RandomState(0)
    out = []
    for step in range(steps):
      feed = {self.noise: 1 + 0.1 * rng.randn(self.num_towers, 3)}
      if step == scale_at:
        feed[self.scale] = 10.0
      _, applied, values = sess.run(
          [self.result.train_op, self.result.applied, self.report], feed)
      out.append((bool(applied), self.opt.describe_skip(values)))
    return out


class WrapperTest(tf.test.TestCase):

  def _session(self, num_towers):
    return self.session(config=tf1.ConfigProto(
        device_count={"CPU": num_towers}))

  def testSkipsTheStepOfAnOutlierTowerAndNamesIt(self):
    with tf.Graph().as_default():
      towers = _Towers(4, 2, skip_tower_outliers=_config())
      with self._session(4) as sess:
        sess.run(tf1.global_variables_initializer())
        steps = towers.run(sess, _S, None)
        before = sess.run(towers.w)
        ((applied, line),) = towers.run(sess, 1, scale_at=0)
        after = sess.run(towers.w)
        criterion = towers.result.reasons.criterion(tower_outliers.REASON)
        by_tower, skips = sess.run([criterion.by_tower, _counter()])
    self.assertEqual([True] * _S, [a for a, _ in steps])
    self.assertFalse(applied)
    self.assertRegex(line, r"^skipped step %d: tower_outlier, tower 2 "
                     r"\(/device:CPU:2\): gradient norm [0-9.]+x the other "
                     r"towers' median \(usually [0-9.]+x\): [0-9.]+ sigma > "
                     r"6, min factor 3$" % _S)
    self.assertAllEqual(before, after)
    self.assertEqual([0, 0, 1, 0], list(by_tower))
    self.assertEqual(1, skips)

  def testWithoutTheCriterionTheStepIsApplied(self):
    with tf.Graph().as_default():
      towers = _Towers(4, 2)
      with self._session(4) as sess:
        sess.run(tf1.global_variables_initializer())
        steps = towers.run(sess, _S + 1, scale_at=_S)
    self.assertEqual([True] * (_S + 1), [a for a, _ in steps])

  def testTwoTowersThatDisagreeSkipWithoutBlamingOne(self):
    with tf.Graph().as_default():
      towers = _Towers(2, 1, skip_tower_outliers=_config())
      with self._session(2) as sess:
        sess.run(tf1.global_variables_initializer())
        steps = towers.run(sess, _S + 2, scale_at=_S)
        criterion = towers.result.reasons.criterion(tower_outliers.REASON)
        by_tower = sess.run(criterion.by_tower)
    self.assertEqual([True] * _S + [False, True], [a for a, _ in steps])
    self.assertRegex(steps[_S][1], "tower 0 \\(/device:CPU:0\\) and tower 1 "
                     "\\(/device:CPU:1\\) disagree: .* cannot be told$")
    self.assertEqual([0, 0], list(by_tower))

  def testADryRunSkipsNothing(self):
    with tf.Graph().as_default():
      towers = _Towers(4, 2, skip_tower_outliers=_config(dry_run=True))
      with self._session(4) as sess:
        sess.run(tf1.global_variables_initializer())
        steps = towers.run(sess, _S + 1, scale_at=_S)
        would_skips = sess.run(_counter(dry_run=True))
    self.assertEqual([True] * (_S + 1), [a for a, _ in steps])
    self.assertEqual(1, would_skips)

  def testReadsWhatEachBatchExplainsGivenAsTowerValues(self):
    # Each tower's gradient is its batch's difficulty (spread over orders
    # of magnitude) times about w; the difficulty is its output gradient
    # norm, given: tower 2's 10x at step _S is named against it.
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=tf.ones([3]))
      difficulty = tf1.placeholder(tf.float32, [4])
      noise = tf1.placeholder(tf.float32, [4, 3])
      scale = tf1.placeholder_with_default(1.0, [])
      towers = []
      for i in range(4):
        with tf1.device("/cpu:%d" % i):
          grad = difficulty[i] * noise[i] * w * (scale if i == 2 else 1.0)
          towers.append([(grad, w)])
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(1e-6),
          skip_tower_outliers=_config())
      result = opt.apply_gradients_with_result(
          [(tf.add_n([t[0][0] for t in towers]) / 4.0, w)],
          tf1.train.get_or_create_global_step(), tower_grads_and_vars=towers,
          tower_values={tower_outliers.OUTPUT_NORM: difficulty,
                        tower_outliers.SHARED_NORM: tf.constant(0.0)})
      report = opt.report_fetches(result.train_op)
      rng = np.random.RandomState(0)
      with self._session(4) as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(_S + 1):
          feed = {difficulty: np.exp(rng.normal(0.0, 1.5, 4)),
                  noise: 1 + 0.1 * rng.randn(4, 3)}
          if step == _S:
            feed[scale] = 10.0
          _, applied, values = sess.run(
              [result.train_op, result.applied, report], feed)
          self.assertEqual(step != _S, bool(applied), step)
    self.assertRegex(opt.describe_skip(values),
                     r"tower 2 \(/device:CPU:2\): gradient norm [0-9.]+x "
                     r"what its batch explains by the other towers")

  def testNeedsEachTowersGradients(self):
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=tf.ones([3]))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.01), skip_tower_outliers=6.0)
      with self.assertRaisesRegex(ValueError, "tower_grads_and_vars"):
        opt.apply_gradients([(w * 2.0, w)])


class _Judged(object):
  """The criterion alone over fed towers: each step's gradient norms,
  output gradient norms and shared gradient norm (`judge`), folded into
  its history after its verdicts are read (as the apply branch does)."""

  def __init__(self, num_towers, with_output=True, **config):
    self.criterion = tower_outliers.TowerOutliers(
        tower_outliers.TowerOutlierConfig(6.0, warmup_steps=20, **config))
    self.norms = tf1.placeholder(tf.float32, [num_towers])
    self.output = tf1.placeholder(tf.float32, [num_towers])
    self.shared = tf1.placeholder(tf.float32, [])
    self.flags = self.criterion.judge(
        self.norms, output=self.output if with_output else None,
        shared=self.shared if with_output else None)
    self.fold = self.criterion.on_apply(None)

  def step(self, sess, norms, output, shared):
    feed = {self.norms: norms, self.output: output, self.shared: shared}
    flags = sess.run(self.flags, feed)
    sess.run(self.fold, feed)
    return list(flags)


def _batches(rng, steps, num_towers=4):
  """Towers of a model that fits most of its batches (small batches):
  each batch's output gradient norm spreads over orders of magnitude (sd
  1.5 in log), its own gradient norm 40x that within about 10%, one batch
  in ten fitted (output norm 1e-4: the gradient is the shared weight
  decay's, norm 0.05)."""
  for _ in range(steps):
    output = np.exp(rng.normal(0.0, 1.5, num_towers))
    output[rng.uniform(size=num_towers) < 0.1] = 1e-4
    own = 40.0 * output * np.exp(rng.normal(0.0, 0.1, num_towers))
    yield np.hypot(own, 0.05), output, 0.05


class StatisticTest(tf.test.TestCase):
  """What a batch explains of its tower's gradient norm: a tower 10x too
  large stands out of towers whose norms spread by orders of magnitude;
  a fitted batch (the shared gradient alone) is no outlier."""

  def _run(self, with_output, scale_every=None, factor=10.0):
    rng = np.random.RandomState(3)
    caught, false = [], 0
    with tf.Graph().as_default():
      judged = _Judged(4, with_output)
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        for s, (norms, output, shared) in enumerate(_batches(rng, 400)):
          tower = s % 4
          if scale_every and s >= 40 and s % scale_every == 0:
            # Undone after its verdict: the history not fed (as the bench).
            bad = norms.copy()
            bad[tower] = factor * norms[tower]
            feed = {judged.norms: bad, judged.output: output,
                    judged.shared: shared}
            caught.append(sess.run(judged.flags, feed)[tower])
            continue
          false += any(judged.step(sess, norms, output, shared))
    return caught, false

  def testATowerTenTimesTooLargeIsCaughtAndCleanTowersAreNot(self):
    caught, false = self._run(True, scale_every=5)
    self.assertEqual(0, false)
    self.assertEqual([True] * len(caught), caught)
    # By the norms alone (the wrapper's towers without output norms) the
    # same towers' spread hides it.
    caught, _ = self._run(False, scale_every=5)
    self.assertLess(sum(caught), len(caught) / 2)

  def testAGradientTooSmallIsNoOutlier(self):
    caught, _ = self._run(True, scale_every=5, factor=0.01)
    self.assertEqual([False] * len(caught), caught)

  def testTheTwinsAgree(self):
    rng = np.random.RandomState(0)
    with tf.Graph().as_default(), self.session() as sess:
      for n in (2, 3, 4, 5):
        norms, output, shared = next(_batches(rng, 1, n))
        for args in ((norms,), (norms, output, shared)):
          self.assertAllClose(
              tower_outliers.log_excess_np(*args),
              sess.run(tower_outliers.log_excess(*[
                  tf.constant(a, tf.float32) for a in args])), rtol=1e-5)


class ConfigTest(tf.test.TestCase):

  def testBadValuesAreNamed(self):
    for kwargs, message in [
        (dict(sigma=0.0), "sigma=0.0 must be a finite number > 0"),
        (dict(sigma=6.0, min_factor=1.0), "min_factor=1.0 must be a finite "
         "number > 1"),
        (dict(sigma=6.0, warmup_steps=0), "warmup_steps=0 must be an "
         "integer >= 1")]:
      with self.assertRaisesRegex(criterion_spec.SpecError, message):
        tower_outliers.TowerOutlierConfig(**kwargs).validate()


if __name__ == "__main__":
  tf.test.main()
