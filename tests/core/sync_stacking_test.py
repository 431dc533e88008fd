"""The wrapper stacked with `SyncReplicasOptimizer`, in both orders.

Written with `tf.compat.v1` only, in the structure (not the code) of two
public scripts, on one worker that is also the chief (replicas_to_aggregate
= total_num_replicas = 1, no spare token: each step waits for its own
apply, so the values read after it are its own):
tf-slim's `train_image_classifier.py --sync_replicas` (the configured
optimizer, ours, wrapped in `SyncReplicasOptimizer` with the EMA as its
`variable_averages`; clone 0's update ops grouped next to the apply) and
`mnist_replica.py` (`SyncReplicasOptimizer` over Adam, `minimize` with
`global_step`, the chief's init ops and queue runner taken from the
optimizer). Blocking ops time out (`operation_timeout_in_ms`): never a hang.
"""

import collections
import os
import threading
import time

import numpy as np
import tensorflow as tf

from tf1_safe_train.cluster import local_cluster_lib
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import sync_statistics

tf1 = tf.compat.v1

SkipNonFiniteOptimizer = optimizer_lib.SkipNonFiniteOptimizer
_NAN_STEP = 1  # Of steps 0..3.


def _config():
  return tf1.ConfigProto(operation_timeout_in_ms=30000)


def _batch(step):
  batch = np.random.RandomState(step).rand(4, 3).astype(np.float32)
  if step == _NAN_STEP:
    batch[1, 2] = np.nan  # a fault in clone 0's batch
  return batch


def _net(x):
  """A dense layer and a batch-norm-like moving mean in UPDATE_OPS, as
  tf-slim's layers make them (model variables)."""
  model = [tf1.GraphKeys.GLOBAL_VARIABLES, tf1.GraphKeys.MODEL_VARIABLES]
  with tf1.variable_scope("net"):
    w = tf1.get_variable("weights", initializer=tf.fill([3, 2], 0.5),
                         collections=model + [
                             tf1.GraphKeys.TRAINABLE_VARIABLES])
    mean = tf1.get_variable("moving_mean", initializer=tf.zeros([3]),
                            trainable=False, collections=model)
  with tf1.name_scope("clone_0"):
    tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
        mean, (mean - tf.reduce_mean(x, 0)) * 0.1))
    return tf.reduce_mean(tf.square(tf.matmul(x - mean, w) - 1.0))


def _kept(values_before, values_after, test):
  for was, kept in zip(values_before, values_after):
    test.assertAllEqual(was, kept)  # bit-identical


def _watched():
  return [v for v in tf1.global_variables() + tf1.local_variables()
          if "skip_shadow" not in v.op.name and
          v.dtype.base_dtype == tf.float32]


def _train(x, train_op, sync_optimizer, train_dir=None):
  """The variables' names and values before and after each step, the skip
  counters and global_step; with `train_dir`, a checkpoint at the end.
  `sync_optimizer` makes the hook (the wrapper outside, or its wrapped)."""
  watched = _watched()
  values = []
  with tf1.train.MonitoredTrainingSession(
      checkpoint_dir=train_dir, save_summaries_steps=None,
      save_summaries_secs=None, config=_config(),
      # Then the queue runner's waiting take is cancelled at once.
      stop_grace_period_secs=1,
      hooks=[sync_optimizer.make_session_run_hook(is_chief=True,
                                                  num_tokens=0)]
      ) as sess:
    values.append(sess.run(watched))
    for step in range(4):
      sess.run(train_op, {x: _batch(step)})
      values.append(sess.run(watched))
    counters = sess.run(counters_lib.skip_counters())
    steps = sess.run(tf1.train.get_global_step())
  return [v.op.name for v in watched], values, counters, steps


class SlimSyncReplicasTest(tf.test.TestCase):
  """train_image_classifier --sync_replicas --moving_average_decay."""

  def _build(self, wrapper_outside, protect=True):
    x = tf1.placeholder(tf.float32, [4, 3], name="images")
    total_loss = _net(x)
    global_step = tf1.train.get_or_create_global_step()
    update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "clone_0")
    variable_averages = tf1.train.ExponentialMovingAverage(0.9, global_step)
    moving_average_variables = tf1.model_variables()
    opt = tf1.train.MomentumOptimizer(0.1, momentum=0.9)
    if not wrapper_outside:
      opt = SkipNonFiniteOptimizer(opt)  # in _configure_optimizer
      opt = tf1.train.SyncReplicasOptimizer(
          opt, replicas_to_aggregate=1, total_num_replicas=1,
          variable_averages=variable_averages,
          variables_to_average=moving_average_variables)
    else:  # The advice's lines, as written (`sync_stacking.ADVICE`).
      opt = SkipNonFiniteOptimizer(tf.compat.v1.train.SyncReplicasOptimizer(
          opt, replicas_to_aggregate=1, total_num_replicas=1,
          variable_averages=variable_averages,
          variables_to_average=moving_average_variables), strict=True)
    grads = opt.compute_gradients(total_loss)  # model_deploy.optimize_clones
    update_ops.append(opt.apply_gradients(grads, global_step=global_step))
    update_op = tf.group(*update_ops)
    with tf1.control_dependencies([update_op]):
      train_op = tf.identity(total_loss, name="train_op")
    if wrapper_outside and protect:
      train_op = opt.protect(train_op)
    # slim.learning.train(sync_optimizer=) wants a SyncReplicasOptimizer
    # itself: the advice's `opt.wrapped_optimizer`.
    sync_optimizer = opt.wrapped_optimizer if wrapper_outside else opt
    self.assertIsInstance(sync_optimizer, tf1.train.SyncReplicasOptimizer)
    return x, train_op, sync_optimizer

  def testInsideIsRefusedAtGraphBuildWithTheOrderThatProtects(self):
    with tf.Graph().as_default():
      with self.assertRaises(ValueError) as refused:
        self._build(wrapper_outside=False)
    told = str(refused.exception)
    for words in ("clone_0/AssignSub", "variable_averages",
                  "`opt = SkipNonFiniteOptimizer(tf.compat.v1.train."
                  "SyncReplicasOptimizer(opt, ...))`",
                  "`train_op = opt.protect(train_op)`",
                  "`opt.wrapped_optimizer`"):
      self.assertIn(words, told)

  def testAdviceFollowedKeepsEverythingOnASkipAndCheckpointsNoNaN(self):
    train_dir = self.get_temp_dir()
    with tf.Graph().as_default():
      names, values, counters, steps = _train(
          *self._build(wrapper_outside=True), train_dir)
    self.assertEqual((4, 3, 1), (steps, counters.applied_steps,
                                 counters.skipped_steps))
    for name in ("net/weights/Momentum", "net/moving_mean",
                 "net/moving_mean/ExponentialMovingAverage",
                 "net/weights/ExponentialMovingAverage"):
      self.assertIn(name, names)
    _kept(values[_NAN_STEP], values[_NAN_STEP + 1], self)
    for moved, was in zip(values[-1], values[_NAN_STEP + 1]):
      self.assertTrue(np.isfinite(moved).all())
      self.assertFalse(np.array_equal(moved, was))
    # The checkpoint written at the end, after the skip: every variable.
    reader = tf1.train.load_checkpoint(train_dir)
    saved = reader.get_variable_to_shape_map()
    self.assertIn("net/moving_mean/ExponentialMovingAverage", saved)
    for name in saved:
      value = reader.get_tensor(name)
      if np.issubdtype(np.asarray(value).dtype, np.floating):
        self.assertTrue(np.isfinite(value).all(), name)

  def testOutsideWithoutProtectIsToldAtTheFirstRun(self):
    # The update ops grouped next to the apply write on the worker, outside
    # every decision: as without SyncReplicas, the first run names them
    # (strict: refuses it) and the line to add.
    with tf.Graph().as_default():
      built = self._build(wrapper_outside=True, protect=False)
      with self.assertRaisesRegex(ValueError, "(?s)outside the skip decision"
                                  ".*net/moving_mean.*opt.protect"):
        _train(*built, self.get_temp_dir())


class MnistReplicaTest(tf.test.TestCase):
  """mnist_replica.py --sync_replicas, the wrapper outside."""

  def testUpdateOpsAroundTheApplyAreRolledBackOnTheWorker(self):
    # The legacy idiom (the first row of docs/wrapper.md's idioms table)
    # with SyncReplicas: the pushes wait for the statistics, the chief's
    # half does not run the worker's forward pass.
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3])
      loss = _net(x)
      global_step = tf1.train.get_or_create_global_step()
      opt = SkipNonFiniteOptimizer(tf1.train.SyncReplicasOptimizer(
          tf1.train.MomentumOptimizer(0.1, momentum=0.9),
          replicas_to_aggregate=1, total_num_replicas=1), strict=True)
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = opt.minimize(loss, global_step=global_step)
      names, values, counters, steps = _train(x, train_op, opt)
    self.assertEqual((4, 3, 1), (steps, counters.applied_steps,
                                 counters.skipped_steps))
    self.assertIn("net/moving_mean", names)
    _kept(values[_NAN_STEP], values[_NAN_STEP + 1], self)
    for value in values[-1]:
      self.assertTrue(np.isfinite(value).all())

  def _run(self, wrapper_outside):
    """mnist_replica's graph and its Supervisor's session, by hand; the
    variables' names and values before and after each step, the counters,
    global_step and the wrapper."""
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3])
      w = tf1.get_variable("hid_w", initializer=tf.fill([3, 2], 0.5))
      loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
      global_step = tf1.Variable(0, name="global_step", trainable=False)
      opt = tf1.train.AdamOptimizer(0.01)
      if not wrapper_outside:
        opt = wrapper = SkipNonFiniteOptimizer(opt, strict=True)
      opt = tf1.train.SyncReplicasOptimizer(
          opt, replicas_to_aggregate=1, total_num_replicas=1,
          name="mnist_sync_replicas")
      if wrapper_outside:
        opt = wrapper = SkipNonFiniteOptimizer(opt, strict=True)
      train_step = opt.minimize(loss, global_step=global_step)
      local_init_op = opt.chief_init_op
      ready_for_local_init_op = opt.ready_for_local_init_op
      chief_queue_runner = opt.get_chief_queue_runner()
      sync_init_op = opt.get_init_tokens_op(0)  # no spare token (above)
      init_op = tf1.global_variables_initializer()
      watched = _watched()
      with tf1.Session(config=_config()) as sess:
        sess.run(init_op)
        self.assertEqual(0, sess.run(ready_for_local_init_op).size)
        sess.run([local_init_op, sync_init_op])
        coord = tf1.train.Coordinator()
        threads = chief_queue_runner.create_threads(sess, coord=coord,
                                                    daemon=True, start=True)
        values = [sess.run(watched)]
        for step in range(4):
          sess.run(train_step, {x: _batch(step)})
          values.append(sess.run(watched))
        counters = sess.run(counters_lib.skip_counters())
        steps = sess.run(global_step)
        coord.request_stop()
      coord.join(threads, stop_grace_period_secs=10)
    return [v.op.name for v in watched], values, counters, steps, wrapper

  def _assertSkippedOnceKeepingEverything(self, names, values, counters,
                                          steps):
    self.assertEqual((4, 3, 1), (steps, counters.applied_steps,
                                 counters.skipped_steps))
    for name in ("hid_w", "hid_w/Adam", "hid_w/Adam_1", "beta1_power"):
      self.assertIn(name, names)
    _kept(values[_NAN_STEP], values[_NAN_STEP + 1], self)
    for moved, was in zip(values[-1], values[_NAN_STEP + 1]):
      self.assertTrue(np.isfinite(moved).all())
      self.assertFalse(np.array_equal(moved, was))

  def testOneLineSkipsOnceAndKeepsWeightsAndSlots(self):
    # The wrapper outside: it answers the SyncReplicas calls the script
    # makes on `opt` (init ops, queue runner, tokens).
    self._assertSkippedOnceKeepingEverything(
        *self._run(wrapper_outside=True)[:4])

  def testInsideWithoutStatisticsSkipsOnTheChiefAndRefusesProtect(self):
    *run, wrapper = self._run(wrapper_outside=False)
    self._assertSkippedOnceKeepingEverything(*run)
    # A worker op keyed on the chief's decision would never finish.
    with self.assertRaisesRegex(ValueError, "never finish.*outside"):
      wrapper.protect(tf.no_op())

class SpareTokensTest(tf.test.TestCase):
  """A spare token can reach a worker before its aggregate is decided."""

  def testNoSpareTokenByDefaultWhereStatisticsAreWrittenToldOtherwise(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3])
      loss = _net(x)
      opt = SkipNonFiniteOptimizer(tf1.train.SyncReplicasOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), 2, 2))
      with tf1.control_dependencies(
          tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        opt.minimize(loss, global_step=tf1.train.get_or_create_global_step())
      # SyncReplicas' default (-1) would enqueue 2 tokens; the calls on the
      # wrapper and on the SyncReplicasOptimizer (slim's) enqueue none.
      for sync in (opt, opt.wrapped_optimizer):
        self.assertEqual("NoOp", sync.get_init_tokens_op().type)
        self.assertEqual(0, sync.make_session_run_hook(True)._num_tokens)  # pylint: disable=protected-access
      with self.assertLogs(level="WARNING") as told:
        self.assertNotEqual("NoOp", opt.get_init_tokens_op(2).type)
      self.assertRegex(told.output[0], "num_tokens=2.*not the chief's skip"
                       ".*num_tokens=0 keeps them")


class GateTest(tf.test.TestCase):
  """`sync_statistics.gate`: a worker's write, kept unless all finite."""

  def testWritesOnlyFiniteValuesOfFiniteGradientsOrOfTheirOwnForward(self):
    with tf.Graph().as_default():
      delta = tf1.placeholder(tf.float32, [2])
      grad = tf1.placeholder(tf.float32, [2])
      mean = tf1.get_variable("mean", initializer=tf.ones([2]))
      var = tf1.get_variable("var", initializer=tf.ones([2]))
      update = tf1.assign_sub(mean, delta)
      # Written in the forward pass the gradient depends on (in place):
      # checked on its value alone, else a cycle.
      in_place = tf1.assign(var, delta)
      with tf1.control_dependencies([in_place]):
        grad_after = tf.identity(grad)
      written, ungated = sync_statistics.gate(
          tf1.train.SyncReplicasOptimizer(
              tf1.train.GradientDescentOptimizer(0.1), 1, 1),
          [update.op, in_place.op], [grad_after])
      self.assertEqual([], ungated)
      with self.session() as sess:
        sess.run(tf1.global_variables_initializer())
        for d, g, expected in (
            ([0.5, 0.5], [1.0, np.nan], ([1.0, 1.0], [0.5, 0.5], False)),
            ([np.inf, 0.5], [1.0, 1.0], ([1.0, 1.0], [0.5, 0.5], False)),
            ([0.25, 0.5], [1.0, 1.0], ([0.75, 0.5], [0.25, 0.5], True))):
          ok, _, _ = sess.run([written, update, grad_after],
                              {delta: d, grad: g})
          self.assertAllEqual(expected[:2], sess.run([mean, var]))
          self.assertEqual(expected[2], ok)


class GlobalStepPolicyTest(tf.test.TestCase):

  def testSkipsThatKeepGlobalStepAreRefusedInBothOrders(self):
    # Such a skip leaves the next pushes stale: the chief's take never
    # completes (seen: a deadline exceeded at the step after the skip).
    for outside in (False, True):
      with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [4, 3])
        w = tf1.get_variable("w", initializer=tf.fill([3, 2], 0.5))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        global_step = tf1.train.get_or_create_global_step()
        opt = tf1.train.GradientDescentOptimizer(0.1)
        wrap = lambda o: SkipNonFiniteOptimizer(
            o, increment_global_step_on_skip=False)
        sync = lambda o: tf1.train.SyncReplicasOptimizer(o, 1, 1)
        opt = wrap(sync(opt)) if outside else sync(wrap(opt))
        with self.assertRaisesRegex(ValueError,
                                    "increment_global_step_on_skip=True"):
          opt.minimize(loss, global_step=global_step)


class TwoWorkersTest(tf.test.TestCase):
  """The wrapper outside, two workers (threads, each its graph and server)
  and a ps: worker 1's batch poisoned once; nobody waits for ever."""

  def _work(self, index, spec, servers, chief_ready, results, pauses=None):
    """Worker `index`'s four steps; with `pauses`, it waits for the test
    before and after each step, and worker 0 publishes its graph and the
    ops a third session reads the ps with (`pauses.probe`)."""
    try:
      with tf.Graph().as_default(), tf1.device(
          tf1.train.replica_device_setter(
              worker_device="/job:worker/task:%d" % index, cluster=spec)):
        x = tf1.placeholder(tf.float32, [4, 3])
        loss = _net(x)
        global_step = tf1.train.get_or_create_global_step()
        opt = SkipNonFiniteOptimizer(tf1.train.SyncReplicasOptimizer(
            tf1.train.MomentumOptimizer(0.1, momentum=0.9),
            replicas_to_aggregate=2, total_num_replicas=2), strict=True)
        with tf1.control_dependencies(
            tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
          train_op = opt.minimize(loss, global_step=global_step)
        watched = _watched()
        if pauses is not None and not index:
          accumulator, device = opt.wrapped_optimizer._accumulator_list[0]  # pylint: disable=protected-access
          with tf1.device(device):
            pauses.probe = (tf1.get_default_graph(), watched,
                            accumulator.num_accumulated(),
                            tf1.train.Saver(sharded=True))
        if index:
          chief_ready.wait(60)  # Then it finds the variables initialised.
        with tf1.train.MonitoredTrainingSession(
            master=servers[index].target, is_chief=not index,
            config=_config(), stop_grace_period_secs=1,
            hooks=[opt.make_session_run_hook(not index, num_tokens=0)]
            ) as sess:
          chief_ready.set()
          values = [sess.run(watched)]
          for step in range(4):
            batch = _batch(step) if index else _batch(10 + step)
            if pauses is not None:
              pauses.reach("before", index, step)
            sess.run(train_op, {x: batch})
            values.append(sess.run(watched))
            if pauses is not None:
              pauses.reach("after", index, step)
          results[index] = ([v.op.name for v in watched], values,
                            sess.run(counters_lib.skip_counters()),
                            sess.run(global_step))
    except Exception as e:  # pylint: disable=broad-except
      results[index] = e

  def _start(self, pauses=None):
    """The servers and the two worker threads, started."""
    ports = local_cluster_lib.free_ports(3)
    spec = tf1.train.ClusterSpec({
        "worker": ["127.0.0.1:%d" % p for p in ports[:2]],
        "ps": ["127.0.0.1:%d" % ports[2]]})
    servers = [tf1.train.Server(spec, job_name="worker", task_index=i)
               for i in range(2)]
    servers.append(tf1.train.Server(spec, job_name="ps", task_index=0))
    chief_ready, results = threading.Event(), {}
    threads = [threading.Thread(
        target=self._work, args=(i, spec, servers, chief_ready, results,
                                 pauses), daemon=True) for i in range(2)]
    for thread in threads:
      thread.start()
    return servers, threads, results

  def _join(self, threads, results):
    for thread in threads:
      thread.join(120)
      self.assertFalse(thread.is_alive())
    for index in range(2):
      if isinstance(results[index], Exception):
        raise results[index]

  def testOneSkipForBothAndTheWeightsKept(self):
    _, threads, results = self._start()
    self._join(threads, results)
    for index in range(2):
      names, values, counters, steps = results[index]
      self.assertEqual((4, 3, 1), (steps, counters.applied_steps,
                                   counters.skipped_steps))
      # The weights and slots change in the chief's apply only, which
      # waits for both pushes of the next step: this worker's reads are
      # exact. (The other worker's statistics may be mid-step.)
      for name, was, kept in zip(names, values[_NAN_STEP],
                                 values[_NAN_STEP + 1]):
        if "moving_mean" not in name:
          self.assertAllEqual(was, kept, name)
      for value in values[-1]:
        self.assertTrue(np.isfinite(value).all())

  def testNoNaNOnThePsWhileTheSkippedStepIsPendingNorInACheckpoint(self):
    # Worker 1 pushes its poisoned step; worker 0 waits: the chief has not
    # decided, and worker 1 waits for its token (no spare one). A third
    # session reads the ps then, as the chief's Saver would, and saves.
    pauses = _Pauses()
    for step in range(4):
      if step not in (_NAN_STEP, _NAN_STEP + 1):
        pauses.let(0, step)
        pauses.let(1, step)
    servers, threads, results = self._start(pauses)
    try:
      for index in range(2):
        pauses.wait("before", index, _NAN_STEP)
      graph, watched, accumulated, saver = pauses.probe
      with tf1.Session(servers[2].target, graph=graph,
                       config=_config()) as sess:
        before = sess.run(watched)
        pauses.let(1, _NAN_STEP)
        deadline = time.time() + 60
        while sess.run(accumulated) < 1:  # Worker 1's push.
          self.assertLess(time.time(), deadline, "worker 1 never pushed")
          time.sleep(0.05)
        pending = sess.run(watched)
        path = saver.save(sess, os.path.join(self.get_temp_dir(), "mid"))
        pauses.let(0, _NAN_STEP)
        for index in range(2):
          pauses.wait("after", index, _NAN_STEP)
        after = sess.run(watched)
      names = [v.op.name for v in watched]
      self.assertIn("net/moving_mean", names)
      for name, value in zip(names, pending):
        self.assertTrue(np.isfinite(value).all(), name)
      reader = tf1.train.load_checkpoint(path)
      for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if np.issubdtype(np.asarray(value).dtype, np.floating):
          self.assertTrue(np.isfinite(value).all(), name)
      for name, was, kept in zip(names, before, after):
        self.assertAllEqual(was, kept, name)  # weights, slots, statistics
    finally:
      pauses.let_all()
      self._join(threads, results)
    for index in range(2):
      _, _, counters, steps = results[index]
      self.assertEqual((4, 3, 1), (steps, counters.applied_steps,
                                   counters.skipped_steps))


class _Pauses(object):
  """Where the worker threads wait for the test (never for ever)."""

  def __init__(self):
    self.probe = None
    self._events = collections.defaultdict(threading.Event)
    self._lock = threading.Lock()

  def _event(self, *key):
    with self._lock:
      return self._events[key]

  def let(self, index, step):
    self._event("go", index, step).set()

  def let_all(self):
    for step in range(4):
      self.let(0, step)
      self.let(1, step)

  def wait(self, where, index, step):
    if not self._event(where, index, step).wait(60):
      raise RuntimeError("worker %d never got %s step %d" % (index, where,
                                                             step))

  def reach(self, where, index, step):
    self._event(where, index, step).set()
    if where == "before":
      self.wait("go", index, step)


if __name__ == "__main__":
  tf.test.main()
