"""Tests for tf1_safe_train.trainer.tower.towers."""

import numpy as np
import tensorflow as tf

from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1


def _device(op_or_tensor):
  """Returns the canonical device string of an op (or a tensor's op)."""
  return tf.DeviceSpec.from_string(op_or_tensor.device).to_string()


class TowerConfigTest(tf.test.TestCase):

  def testGpuDevicesAndScopes(self):
    config = towers.TowerConfig(num_towers=2, device_type='gpu')
    self.assertEqual('/device:GPU:0', config.tower_device(0))
    self.assertEqual('/device:GPU:1', config.tower_device(1))
    self.assertEqual('tower_0', config.tower_scope(0))
    self.assertEqual('tower_1', config.tower_scope(1))
    self.assertEqual('/device:CPU:0', config.variables_device())

  def testCpuDevices(self):
    config = towers.TowerConfig(num_towers=3, device_type='CPU')
    self.assertEqual('cpu', config.device_type)
    self.assertEqual(['/device:CPU:0', '/device:CPU:1', '/device:CPU:2'],
                     [config.tower_device(i) for i in range(3)])

  def testRejectsBadNumTowers(self):
    for bad in (0, -1, 'x', 1.0, True, None):
      with self.assertRaisesRegex(ValueError, 'num_towers.*%r' % (bad,)):
        towers.TowerConfig(num_towers=bad)

  def testRejectsBadDeviceType(self):
    with self.assertRaisesRegex(ValueError, "device_type.*'tpu'"):
      towers.TowerConfig(num_towers=1, device_type='tpu')

  def testRejectsBadVariablesDevice(self):
    with self.assertRaisesRegex(ValueError, 'variables_device.*3'):
      towers.TowerConfig(variables_device=3)

  def testRejectsTowerIndexOutOfRange(self):
    config = towers.TowerConfig(num_towers=2)
    for bad in (2, -1, '0'):
      with self.assertRaisesRegex(ValueError, 'tower index.*%r' % (bad,)):
        config.tower_device(bad)
      with self.assertRaises(ValueError):
        config.tower_scope(bad)

  def testIsImmutableAndComparable(self):
    config = towers.TowerConfig(num_towers=2)
    with self.assertRaises(AttributeError):
      config.num_towers = 3
    self.assertEqual(config, towers.TowerConfig(num_towers=2))
    self.assertNotEqual(config, towers.TowerConfig(num_towers=3))
    self.assertEqual(hash(config), hash(towers.TowerConfig(num_towers=2)))

  def testSessionConfigCpuHasOneDevicePerTower(self):
    proto = towers.session_config(
        towers.TowerConfig(num_towers=3, device_type='cpu'))
    self.assertEqual(3, proto.device_count['CPU'])
    self.assertTrue(proto.allow_soft_placement)
    self.assertFalse(proto.log_device_placement)

  def testSessionConfigGpuLeavesDeviceCount(self):
    proto = towers.session_config(
        towers.TowerConfig(num_towers=2), allow_soft_placement=False,
        log_device_placement=True)
    self.assertNotIn('CPU', proto.device_count)
    self.assertFalse(proto.allow_soft_placement)
    self.assertTrue(proto.log_device_placement)


class TowerDeviceFnTest(tf.test.TestCase):

  def testVariablesOnCpuComputeOnTowerGpu(self):
    config = towers.TowerConfig(num_towers=2, device_type='gpu')
    with tf.Graph().as_default():
      with tf1.device(config.tower_device_fn(1)):
        w = tf1.get_variable('w', [2, 2])
        y = tf.matmul(tf.ones([1, 2]), w)
      self.assertEqual('VarHandleOp', w.op.type)
      self.assertEqual('/device:CPU:0', _device(w.op))
      self.assertEqual('MatMul', y.op.type)
      self.assertEqual('/device:GPU:1', _device(y.op))

  def testRefVariableOnCpu(self):
    config = towers.TowerConfig(num_towers=2, device_type='gpu')
    with tf.Graph().as_default():
      with tf1.device(config.tower_device_fn(1)):
        w = tf1.get_variable('w', [2], use_resource=False)
      self.assertEqual('VariableV2', w.op.type)
      self.assertEqual('/device:CPU:0', _device(w.op))

  def testInnerDeviceScopeWins(self):
    config = towers.TowerConfig(num_towers=2, device_type='gpu')
    with tf.Graph().as_default():
      with tf1.device(config.tower_device_fn(1)):
        with tf1.device('/device:CPU:0'):
          x = tf.ones([2]) * 2.0
      self.assertEqual('/device:CPU:0', _device(x.op))

  def testVariablesDeviceFunctionIsCalled(self):
    setter = tf1.train.replica_device_setter(ps_tasks=2)
    config = towers.TowerConfig(num_towers=2, variables_device=setter)
    self.assertIs(setter, config.variables_device())
    with tf.Graph().as_default():
      with tf1.device(config.tower_device_fn(0)):
        a = tf1.get_variable('a', [1])
        b = tf1.get_variable('b', [1])
        y = a + b
      self.assertEqual('/job:ps/task:0', a.op.device)
      self.assertEqual('/job:ps/task:1', b.op.device)
      self.assertEqual('/device:GPU:0', _device(y.op))


class BuildTowersTest(tf.test.TestCase):

  def _build(self, num_towers):
    config = towers.TowerConfig(num_towers=num_towers, device_type='cpu')

    def tower_fn(i):
      w = tf1.get_variable('w', [2], initializer=tf1.ones_initializer())
      x = tf.constant([1.0, 2.0]) * float(i + 1)
      return tf.reduce_sum(x * w, name='loss'), w

    return config, towers.build_towers(config, tower_fn)

  def testSharesVariablesAndScopesOps(self):
    for num_towers in (2, 3):
      with tf.Graph().as_default():
        config, results = self._build(num_towers)
        self.assertLen(results, num_towers)
        variables = tf1.global_variables()
        self.assertEqual(['w:0'], [v.name for v in variables])
        for i, (loss, w) in enumerate(results):
          self.assertIs(variables[0], w)
          self.assertEqual('tower_%d/loss:0' % i, loss.name)
          self.assertEqual('/device:CPU:%d' % i, _device(loss.op))
        self.assertEqual('/device:CPU:0', _device(variables[0].op))

  def testRunsOnVirtualCpus(self):
    with tf.Graph().as_default():
      config, results = self._build(3)
      init = tf1.global_variables_initializer()
      losses = [loss for loss, _ in results]
      with tf1.Session(config=towers.session_config(config)) as sess:
        sess.run(init)
        options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
        metadata = tf1.RunMetadata()
        values = sess.run(losses, options=options, run_metadata=metadata)
    self.assertAllClose([3.0, 6.0, 9.0], values)
    devices = {stats.device for stats in metadata.step_stats.dev_stats}
    for i in range(3):
      self.assertIn('/job:localhost/replica:0/task:0/device:CPU:%d' % i,
                    devices)

  def testRejectsBadArguments(self):
    with self.assertRaisesRegex(ValueError, 'TowerConfig'):
      towers.build_towers(2, lambda i: i)
    with self.assertRaisesRegex(ValueError, 'callable'):
      towers.build_towers(towers.TowerConfig(), None)


class AverageGradientsTest(tf.test.TestCase):

  def testDenseMean(self):
    with tf.Graph().as_default():
      with tf1.device('/device:CPU:0'):
        v = tf1.get_variable('v', [3])
      g0 = tf.constant([1.0, 2.0, 3.0])
      g1 = tf.constant([3.0, 2.0, -3.0])
      g2 = tf.constant([2.0, 5.0, 0.0])
      (avg, var), = towers.average_gradients([[(g0, v)], [(g1, v)], [(g2, v)]])
      self.assertIs(v, var)
      self.assertEqual('/device:CPU:0', _device(avg.op))
      with self.cached_session():
        self.assertAllClose([2.0, 3.0, 0.0], self.evaluate(avg))

  def testIndexedSlicesMean(self):
    with tf.Graph().as_default():
      emb = tf1.get_variable(
          'emb', initializer=np.arange(8, dtype=np.float32).reshape(4, 2))
      loss0 = tf.reduce_sum(tf.nn.embedding_lookup(emb, [0, 2]))
      loss1 = tf.reduce_sum(3.0 * tf.gather(emb, [2, 3, 2]))
      g0, = tf.gradients(loss0, [emb])
      g1, = tf.gradients(loss1, [emb])
      self.assertIsInstance(g0, tf.IndexedSlices)
      self.assertIsInstance(g1, tf.IndexedSlices)
      (avg, _), = towers.average_gradients([[(g0, emb)], [(g1, emb)]])
      self.assertIsInstance(avg, tf.IndexedSlices)
      dense = tf.convert_to_tensor(avg)
      with self.cached_session():
        self.evaluate(tf1.global_variables_initializer())
        self.assertAllEqual([4, 2], self.evaluate(avg.dense_shape))
        # Row counts: tower 0 hits rows 0, 2 once; tower 1 hits row 2 twice
        # and row 3 once, each with weight 3. Mean over 2 towers.
        expected = np.array([[0.5] * 2, [0.0] * 2, [3.5] * 2, [1.5] * 2])
        self.assertAllClose(expected, self.evaluate(dense))

  def testMixedDenseAndSparseIsDensified(self):
    with tf.Graph().as_default():
      v = tf1.get_variable('v', [3, 1])
      sparse = tf.IndexedSlices(tf.constant([[4.0]]), tf.constant([1]),
                                tf.constant([3, 1]))
      dense = tf.constant([[2.0], [2.0], [2.0]])
      (avg, _), = towers.average_gradients([[(sparse, v)], [(dense, v)]])
      self.assertIsInstance(avg, tf.Tensor)
      with self.cached_session():
        self.assertAllClose([[1.0], [3.0], [1.0]], self.evaluate(avg))

  def testNoneHandling(self):
    with tf.Graph().as_default():
      a = tf1.get_variable('a', [2])
      b = tf1.get_variable('b', [2])
      g = tf.constant([2.0, 4.0])
      result = towers.average_gradients([[(None, a), (g, b)],
                                         [(None, a), (None, b)]])
      self.assertIsNone(result[0][0])
      self.assertIs(a, result[0][1])
      with self.cached_session():
        # A None counts as zero: (g + 0) / 2.
        self.assertAllClose([1.0, 2.0], self.evaluate(result[1][0]))

  def testSingleTowerReturnsSameTensors(self):
    with tf.Graph().as_default() as graph:
      v = tf1.get_variable('v', [2])
      w = tf1.get_variable('w', [2])
      g = tf.constant([1.0, 2.0])
      num_ops = len(graph.get_operations())
      result = towers.average_gradients([[(g, v), (None, w)]])
      self.assertLen(result, 2)
      self.assertIs(g, result[0][0])
      self.assertIs(v, result[0][1])
      self.assertIsNone(result[1][0])
      self.assertEqual(num_ops, len(graph.get_operations()))

  def testRejectsMismatchedVariables(self):
    with tf.Graph().as_default():
      v = tf1.get_variable('v', [2])
      w = tf1.get_variable('w', [2])
      g = tf.constant([1.0, 2.0])
      with self.assertRaisesRegex(ValueError, 'tower 1'):
        towers.average_gradients([[(g, v), (g, w)], [(g, w), (g, v)]])
      with self.assertRaisesRegex(ValueError, 'tower 1'):
        towers.average_gradients([[(g, v), (g, w)], [(g, v)]])
      with self.assertRaisesRegex(ValueError, 'empty'):
        towers.average_gradients([])


if __name__ == '__main__':
  tf.test.main()
