"""Tests for tf1_safe_train.trainer.drills.injection."""

import math

import numpy as np
import tensorflow as tf

from tf1_safe_train.trainer.drills import injection

tf1 = tf.compat.v1

Rule = injection.Rule
_NAN, _INF = math.nan, math.inf


class ParseSpecTest(tf.test.TestCase):

  def testEmptySpecHasNoRules(self):
    self.assertEqual((), injection.parse_spec(''))
    self.assertEqual((), injection.parse_spec('   '))
    self.assertEqual((), injection.parse_spec(None))

  def testSingleStep(self):
    rule, = injection.parse_spec('nan@5')
    self.assertEqual('nan', rule.kind)
    self.assertTrue(math.isnan(rule.value))
    self.assertEqual((5, 5, None, 0, 0), (rule.first_step, rule.last_step,
                                          rule.prob, rule.tower, rule.worker))

  def testScaleKindIsAFiniteFactor(self):
    rule, = injection.parse_spec('Scale1e4@7:1')
    self.assertEqual(('scale1e4', 1e4, 7, 1), (rule.kind, rule.value,
                                               rule.first_step, rule.tower))
    self.assertTrue(injection.is_scale(rule))
    self.assertEqual('scale1e4@7:1/0', str(rule))
    self.assertFalse(injection.is_scale(injection.parse_spec('nan@1')[0]))

  def testFiniteKinds(self):
    flip, stale, every = injection.parse_spec(
        'BitFlip31@7:1, stale%0.5:2, bitflip0@10-~20/1')
    self.assertEqual(Rule('bitflip31', 31.0, 7, 7, None, 1, 0), flip)
    self.assertEqual(Rule('stale', 0.0, 0, None, 0.5, 2, 0), stale)
    self.assertEqual(Rule('bitflip0', 0.0, 10, None, None, 0, 1, 20), every)
    self.assertEqual(['bitflip', 'stale', 'bitflip', 'value', 'scale'],
                     [injection.group(r) for r in (flip, stale, every) +
                      injection.parse_spec('nan@1,scale2@1')])
    self.assertEqual('bitflip0@10-~20:0/1,bitflip31@3-9~2:0/0',
                     ','.join(str(r) for r in injection.parse_spec(
                         'bitflip0@10-~20/1,bitflip31@3-9~2')))

  def testRangeOpenRangeTowerAndWorker(self):
    rules = injection.parse_spec(' inf@3-7:1 , -inf@10-/2 ,NaN@0:2/3')
    self.assertEqual(
        (Rule('inf', _INF, 3, 7, None, 1, 0),
         Rule('-inf', -_INF, 10, None, None, 0, 2),
         Rule('nan', rules[2].value, 0, 0, None, 2, 3)), rules)
    self.assertTrue(math.isnan(rules[2].value))

  def testProbability(self):
    rule, = injection.parse_spec('-inf%0.25:1/1')
    self.assertEqual(Rule('-inf', -_INF, 0, None, 0.25, 1, 1), rule)
    rule, = injection.parse_spec('nan%1')
    self.assertEqual(1.0, rule.prob)

  def testStrRoundTrips(self):
    spec = 'nan@5,inf@3-7:1,-inf@10-/2,nan%0.01:1/1'
    rules = injection.parse_spec(spec)
    self.assertEqual('nan@5:0/0,inf@3-7:1/0,-inf@10-:0/2,nan%0.01:1/1',
                     ','.join(str(r) for r in rules))
    self.assertEqual(rules,
                     injection.parse_spec(','.join(str(r) for r in rules)))

  def testRejectsMalformedItems(self):
    cases = {
        '@5': 'KIND must be',
        'nul@5': "KIND must be nan, inf, -inf, scaleF (e.g. scale1e4), "
                 "bitflipK (K 0-31) or stale, got 'nul'",
        'bitflip@5': 'KIND must be',
        'bitflip32@5': 'bitflip bit must be 0-31',
        'bitflip-1@5': 'KIND must be',
        'stale1@5': 'KIND must be',
        'nan@5~2': '~S needs a range N-M~S or N-~S',
        'nan@5-9~0': '~S needs a range',
        'nan@5-9~': 'STEPS must be N, N-M or N- (a range optionally ~S)',
        'nan%0.5~2': 'PROB must be',
        'scale@5': 'KIND must be',
        'scalex@5': 'KIND must be',
        'scale0@5': 'scale factor must be a finite number > 0',
        'scale1e999@5': 'scale factor must be a finite number > 0',
        '@': 'KIND must be',
        'nan': 'expected KIND@STEPS',
        'nan@': 'STEPS must be N, N-M or N-',
        'nan@x:1': 'STEPS must be N, N-M or N-',
        'nan@5-3': "STEPS range '5-3' is empty",
        'nan@-1': 'STEPS must be N, N-M or N-',
        'nan@1.5': 'STEPS must be',
        'nan@9223372036854775808': 'STEPS must be below 2**63',
        'nan%0': 'PROB must be a number in',
        'nan%1.5': 'PROB must be a number in',
        'nan%-0.1': 'PROB must be',
        'nan%nan': 'PROB must be',
        'nan%x': 'PROB must be',
        'nan@5:x': "TOWER must be a non-negative integer, got 'x'",
        'nan@5:-1': 'TOWER must be a non-negative integer',
        'nan@5:': 'TOWER must be',
        'nan@5/x': "WORKER must be a non-negative integer, got 'x'",
        'nan@5/1:0': 'WORKER must be',
    }
    for item, message in cases.items():
      with self.assertRaises(injection.InjectionSpecError) as ctx:
        injection.parse_spec('inf@1,' + item)
      text = str(ctx.exception)
      self.assertIn("--inject_nonfinite item '%s': " % item, text)
      self.assertIn(message, text)
      self.assertNotIn('\n', text)
      self.assertIsInstance(ctx.exception, ValueError)

  def testRejectsStrayCommas(self):
    for spec in ('nan@1,', 'nan@1,,inf@2', ',nan@1'):
      with self.assertRaisesRegex(injection.InjectionSpecError,
                                  'empty .stray comma'):
        injection.parse_spec(spec)

  def testRejectsNonString(self):
    with self.assertRaises(injection.InjectionSpecError):
      injection.parse_spec(5)

  def testValidateTowerAndWorkerRange(self):
    rules = injection.parse_spec('nan@1:1/2')
    injection.validate(rules, num_towers=2, num_workers=3)
    with self.assertRaisesRegex(injection.InjectionSpecError,
                                r"'nan@1:1/2': TOWER 1 out of range"):
      injection.validate(rules, num_towers=1, num_workers=3)
    with self.assertRaisesRegex(injection.InjectionSpecError,
                                'WORKER 2 out of range, there are 2'):
      injection.validate(rules, num_towers=2, num_workers=2)
    injection.validate((), num_towers=1)

  def testValidateGradientOnlyKindsNeedTheGradientTarget(self):
    rules = injection.parse_spec('scale2@1,stale@3')
    injection.validate(rules, 1, target='grads')
    injection.validate(rules[:1], 1, target='loss')
    with self.assertRaisesRegex(
        injection.InjectionSpecError,
        r"^--inject_nonfinite item 'stale@3:0/0': stale faults a tower's "
        r"gradients; it needs --inject_into=grads, not input$"):
      injection.validate(rules, 1, target='input')


class ActiveValueTest(tf.test.TestCase):

  def testUniformGraphMatchesPythonBitForBit(self):
    steps = np.arange(-5, 10000, dtype=np.int64)
    with tf.Graph().as_default():
      key = injection._rule_key(seed=17, rule_index=2)
      u = injection.uniform_graph(key, tf.constant(steps))
      with self.cached_session():
        graph_u = self.evaluate(u)
    python_u = np.array([injection.uniform(key, int(s)) for s in steps])
    self.assertEqual(np.float64, graph_u.dtype)
    self.assertAllEqual(python_u.view(np.uint64), graph_u.view(np.uint64))
    self.assertTrue(((graph_u >= 0.0) & (graph_u < 1.0)).all())
    self.assertNear(0.5, graph_u.mean(), 0.01)

  def testActiveValueMatchesIsActive(self):
    spec = 'nan@3,inf@5-8:1,-inf@20-,nan%0.3,inf%0.05:1,-inf%0.5/1,nan@4/1'
    rules = injection.parse_spec(spec)
    steps = np.arange(0, 10000, dtype=np.int64)
    cases = [(t, w, seed) for t in (0, 1, 2) for w in (0, 1) for seed in (0, 7)]
    with tf.Graph().as_default():
      step = tf1.placeholder(tf.int64, [None])
      outputs = [injection.active_value(rules, step, t, w, seed)
                 for t, w, seed in cases]
      with self.cached_session() as sess:
        results = sess.run(outputs, {step: steps})
    for (tower, worker, seed), (active, value) in zip(cases, results):
      self.assertEqual(np.float32, value.dtype)
      # A tower without rules gets scalar constants.
      active = np.broadcast_to(active, steps.shape)
      value = np.broadcast_to(value, steps.shape)
      expected = [injection.is_active(rules, int(s), tower, worker, seed)
                  for s in steps]
      self.assertAllEqual([a for a, _ in expected], active)
      expected_value = np.array([v for _, v in expected], np.float32)
      self.assertAllEqual(expected_value.view(np.uint32), value.view(np.uint32))

  def testEveryGroupAndStrideMatchIsActive(self):
    spec = ('bitflip30@3-40~4:1,scale2@5-~3,stale%0.2,bitflip22%0.5,'
            'nan@6-50~7,stale@0-~2:1')
    rules = injection.parse_spec(spec)
    steps = np.arange(0, 200, dtype=np.int64)
    with tf.Graph().as_default():
      step = tf1.placeholder(tf.int64, [None])
      outputs = [injection.active_value(rules, step, t, seed=3, kind_group=g)
                 for t in (0, 1) for g in injection.GROUPS]
      with self.cached_session() as sess:
        results = sess.run(outputs, {step: steps})
    cases = [(t, g) for t in (0, 1) for g in injection.GROUPS]
    for (tower, name), (active, value) in zip(cases, results):
      active = np.broadcast_to(active, steps.shape)
      value = np.broadcast_to(value, steps.shape)
      expected = [injection.is_active(rules, int(s), tower, seed=3,
                                      kind_group=name) for s in steps]
      self.assertAllEqual([a for a, _ in expected], active)
      self.assertAllEqual([v for _, v in expected], value)
      fired = [any(injection.group(r) == name for r in
                   injection.active_rules(rules, int(s), tower, seed=3))
               for s in steps]
      self.assertAllEqual(fired, active)
    self.assertEqual([3, 7, 11], [s for s in range(12) if injection.is_active(
        rules, s, 1, kind_group='bitflip')[0]])

  def testFirstRuleWinsAndRateIsCloseToProb(self):
    rules = injection.parse_spec('inf@3-5,nan%0.3,-inf@5-')
    self.assertEqual((True, _INF), injection.is_active(rules, 4, 0))
    self.assertFalse(injection.is_active(rules, 2, 1)[0])
    hits = [injection.is_active(rules, s, 0)[0] for s in range(6, 10006)]
    self.assertEqual(10000, sum(hits))  # -inf@5- catches the rest.
    nan_hits = [math.isnan(injection.is_active(rules, s, 0, seed=3)[1])
                for s in range(6, 10006)]
    self.assertNear(0.3, np.mean(nan_hits), 0.02)

  def testSeedChangesProbabilityStream(self):
    rules = injection.parse_spec('nan%0.5')
    a = [injection.is_active(rules, s, 0, seed=1)[0] for s in range(64)]
    b = [injection.is_active(rules, s, 0, seed=2)[0] for s in range(64)]
    self.assertNotEqual(a, b)
    self.assertEqual(
        a, [injection.is_active(rules, s, 0, seed=1)[0] for s in range(64)])

  def testScalarGlobalStep(self):
    rules = injection.parse_spec('nan@1:1')
    with tf.Graph().as_default():
      global_step = tf1.train.get_or_create_global_step()
      active0, value0 = injection.active_value(rules, global_step.read_value(),
                                               tower=0)
      active1, value1 = injection.active_value(rules, global_step.read_value(),
                                               tower=1)
      self.assertEqual(False, tf.get_static_value(active0))
      self.assertEqual([], active1.shape.as_list())
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        self.assertEqual((False, 0.0), tuple(sess.run([active1, value1])))
        sess.run(global_step.assign(1))
        active, value = sess.run([active1, value1])
        self.assertTrue(active)
        self.assertTrue(np.isnan(value))
        self.assertEqual((False, 0.0), tuple(sess.run([active0, value0])))


class PoisonTest(tf.test.TestCase):

  def testPoisonsEveryKindAndDtype(self):
    x_np = np.array([[1.0, -2.0], [3.0, 0.5]])
    with tf.Graph().as_default():
      active = tf1.placeholder(tf.bool, [])
      cases = []
      for dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
        for value in (_NAN, _INF, -_INF):
          x = tf.constant(x_np, dtype)
          y = injection.poison(x, active, tf.constant(value, tf.float32))
          self.assertEqual(dtype, y.dtype)
          cases.append((value, tf.cast(y, tf.float64)))
      with self.cached_session() as sess:
        on = sess.run([y for _, y in cases], {active: True})
        off = sess.run([y for _, y in cases], {active: False})
    for (value, _), y_on, y_off in zip(cases, on, off):
      self.assertAllEqual(x_np, y_off)
      if math.isnan(value):
        self.assertTrue(np.isnan(y_on).all())
      else:
        self.assertAllEqual(np.full_like(x_np, value), y_on)

  def testIndexedSlices(self):
    with tf.Graph().as_default():
      slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([1]),
                                tf.constant([3, 2]))
      y = injection.poison(slices, tf.constant(True), _INF)
      self.assertIsInstance(y, tf.IndexedSlices)
      self.assertIs(slices.indices, y.indices)
      self.assertIs(slices.dense_shape, y.dense_shape)
      z = injection.poison(slices, tf1.placeholder_with_default(False, []),
                           _NAN)
      with self.cached_session():
        self.assertAllEqual([[_INF, _INF]], self.evaluate(y.values))
        self.assertAllEqual([[1.0, 2.0]], self.evaluate(z.values))

  def testStaticallyInactiveAddsNoOp(self):
    with tf.Graph().as_default() as graph:
      x = tf.constant([1.0])
      num_ops = len(graph.get_operations())
      self.assertIs(x, injection.poison(x, tf.constant(False), _NAN))
      self.assertIs(x, injection.poison(x, False, _NAN))
      self.assertEqual(num_ops + 1, len(graph.get_operations()))

  def testRejectsIntegerTensor(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, 'int32'):
        injection.poison(tf.constant([1]), True, _NAN)

  def testGradientIsIdentityWhenInactiveAndFinite(self):
    with tf.Graph().as_default():
      active = tf1.placeholder(tf.bool, [])
      x = tf.constant([1.0, 2.0, 3.0])
      y = injection.poison(x, active, _NAN)
      grad, = tf.gradients(tf.reduce_sum(y * y), [x])
      with self.cached_session() as sess:
        y_off, grad_off = sess.run([y, grad], {active: False})
        y_on, grad_on = sess.run([y, grad], {active: True})
    self.assertAllEqual([1.0, 2.0, 3.0], y_off)
    self.assertAllEqual([2.0, 4.0, 6.0], grad_off)
    self.assertTrue(np.isnan(y_on).all())
    self.assertFalse(np.isnan(grad_off).any())
    self.assertAllEqual([0.0, 0.0, 0.0], grad_on)


class ExpectedInjectionsTest(tf.test.TestCase):

  def testStepRangeAndOpenRangeCounts(self):
    rules = injection.parse_spec('nan@3,inf@5-8:1,-inf@20-:2,nan@4:0/1')
    counts, steps = injection.expected_injections(rules, num_steps=30,
                                                  num_towers=3)
    self.assertEqual([1, 4, 10], counts)
    self.assertEqual({3, 5, 6, 7, 8} | set(range(20, 30)), steps)
    counts, steps = injection.expected_injections(rules, 10, 3, worker=1)
    self.assertEqual(([1, 0, 0], {4}), (counts, steps))
    counts, steps = injection.expected_injections(rules, 5, 3, start_step=6)
    self.assertEqual(([0, 3, 0], {6, 7, 8}), (counts, steps))

  def testOverlappingRulesCountOncePerStep(self):
    rules = injection.parse_spec('nan@0-9,inf@5-14')
    counts, steps = injection.expected_injections(rules, 100, 1)
    self.assertEqual(([15], set(range(15))), (counts, steps))

  def testProbabilityCountMatchesGraph(self):
    rules = injection.parse_spec('nan%0.1,inf%0.2:1')
    counts, steps = injection.expected_injections(rules, 2000, 2, seed=5)
    self.assertNear(200, counts[0], 40)
    self.assertNear(400, counts[1], 60)
    with tf.Graph().as_default():
      step = tf.range(2000, dtype=tf.int64)
      active = [injection.active_value(rules, step, t, seed=5)[0]
                for t in range(2)]
      with self.cached_session():
        graph_active = self.evaluate(active)
    self.assertEqual(counts, [int(a.sum()) for a in graph_active])
    self.assertEqual(steps, set(np.flatnonzero(graph_active[0] |
                                               graph_active[1]).tolist()))


class FlipBitTest(tf.test.TestCase):

  def testFlipsTheBitOfTheLargestElementBitForBit(self):
    # A tie of magnitudes (-3 and 3): the first in row-major order.
    x = np.array([[0.5, -3.0, 1e-3], [3.0, 2.5e-7, -0.25]], np.float32)
    bits = (31, 30, 27, 23, 22, 0)
    with tf.Graph().as_default():
      bit = tf1.placeholder(tf.int32, [])
      active = tf1.placeholder(tf.bool, [])
      out = injection.flip_bit(tf.constant(x), bit, active)
      with self.cached_session() as sess:
        for k in bits:
          got = sess.run(out, {bit: k, active: True})
          want = x.copy().reshape(-1)
          want.view(np.uint32)[1] ^= np.uint32(1 << k)
          self.assertAllEqual(want.reshape(x.shape).view(np.uint32),
                              got.view(np.uint32))
          twin, index = injection.flip_bit_numpy(x, k)
          self.assertEqual(1, index)
          self.assertAllEqual(twin.view(np.uint32), got.view(np.uint32))
          self.assertAllEqual(x.view(np.uint32), sess.run(
              out, {bit: k, active: False}).view(np.uint32))
    # What the bits of -3.0 (exponent field 128) mean: the sign; the
    # exponent's top bit (128 -> 0: the subnormal -2**-127); its lowest
    # (128 -> 129: doubled).
    self.assertEqual(3.0, injection.flip_bit_numpy(x, 31)[0][0, 1])
    self.assertEqual(-2.0**-127, injection.flip_bit_numpy(x, 30)[0][0, 1])
    self.assertEqual(-6.0, injection.flip_bit_numpy(x, 23)[0][0, 1])

  def testRejectsOtherDtypes(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, 'needs a float32 tensor'):
        injection.flip_bit(tf.constant([1.0], tf.float16), 3, True)


class StaleTest(tf.test.TestCase):

  def testActiveGivesThePreviousRunsValue(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [2])
      active = tf1.placeholder(tf.bool, [])
      out = injection.stale(x, active)
      self.assertEqual([], tf1.global_variables())
      with self.cached_session() as sess:
        sess.run(tf1.local_variables_initializer())
        feeds = [([1.0, 2.0], True), ([3.0, 4.0], False), ([5.0, 6.0], True),
                 ([7.0, 8.0], True), ([9.0, 0.0], False)]
        got = [sess.run(out, {x: v, active: a}).tolist() for v, a in feeds]
    # The first run has no previous value: zeros.
    self.assertEqual([[0.0, 0.0], [3.0, 4.0], [3.0, 4.0], [5.0, 6.0],
                      [9.0, 0.0]], got)


if __name__ == '__main__':
  tf.test.main()
