"""The one-line migration in the structure of public TF1 scripts.

Written with `tf.compat.v1` only, in the structure (not the code) of:
tf-slim's `train_image_classifier.py` over `model_deploy` (clone 0's update
ops and the EMA's apply grouped next to `apply_gradients`, a Supervisor
loop as `slim.learning.train` runs), BERT's `optimization.create_optimizer`
(an optimizer whose `apply_gradients` ignores `global_step`, and the
script's own increment grouped with the train op) and tf_cnn_benchmarks'
replicated mode (one optimizer per device, each applying once, grouped with
tower 0's update ops). With only the wrapper line each is told at its first
run what is not protected and the line to add; with that line it is clean.
"""

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib

tf1 = tf.compat.v1

_DEVICES = ("/device:CPU:0", "/device:CPU:1")


def _config():
  return tf1.ConfigProto(device_count={"CPU": 2})


def _batch(seed, nan=False):
  batch = np.random.RandomState(seed).rand(4, 3).astype(np.float32)
  if nan:
    batch[1, 2] = np.nan
  return batch


def _net(x, scope):
  """A dense layer and a batch-norm-like moving mean in UPDATE_OPS."""
  with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
    # Model variables, as tf-slim's layers make them.
    model = [tf1.GraphKeys.GLOBAL_VARIABLES, tf1.GraphKeys.MODEL_VARIABLES]
    w = tf1.get_variable("weights", initializer=tf.fill([3, 2], 0.5),
                         collections=model + [
                             tf1.GraphKeys.TRAINABLE_VARIABLES])
    mean = tf1.get_variable("moving_mean", initializer=tf.zeros([3]),
                            trainable=False, collections=model)
  with tf1.name_scope(scope):
    tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign_sub(
        mean, (mean - tf.reduce_mean(x, 0)) * 0.1))
    return tf.reduce_mean(tf.square(tf.matmul(x - mean, w) - 1.0))


def _warnings(logs, text):
  return [line for line in logs.output if text in line]


class SlimTrainImageClassifierTest(tf.test.TestCase):
  """model_deploy clones, EMA, update ops grouped next to the apply."""

  def _build(self, protect, strict=False):
    inputs, losses = [], []
    for i, device in enumerate(_DEVICES):  # model_deploy's clones
      with tf.device(device):
        x = tf1.placeholder(tf.float32, [4, 3], name="images_%d" % i)
        inputs.append(x)
        losses.append(_net(x, "clone_%d" % i))
    global_step = tf1.train.get_or_create_global_step()
    update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "clone_0")
    ema = tf1.train.ExponentialMovingAverage(0.99, global_step)
    update_ops.append(ema.apply(tf1.model_variables()))
    optimizer = tf1.train.MomentumOptimizer(0.1, momentum=0.9)
    optimizer = optimizer_lib.SkipNonFiniteOptimizer(optimizer, strict=strict)
    total_loss = tf.add_n(losses) / len(losses)
    grads = optimizer.compute_gradients(total_loss)
    update_ops.append(optimizer.apply_gradients(grads,
                                                global_step=global_step))
    update_op = tf.group(*update_ops)
    with tf1.control_dependencies([update_op]):
      train_tensor = tf.identity(total_loss, name="train_op")
    if protect:  # the line the warning says
      train_tensor = optimizer.protect(train_tensor)
    watched = [v for v in tf1.global_variables()
               if "moving_mean" in v.op.name or
               "ExponentialMovingAverage" in v.op.name]
    watched = [v for v in watched if "skip_shadow" not in v.op.name]
    return inputs, train_tensor, global_step, watched

  def _train(self, inputs, train_tensor, global_step, watched, nan_step=-1):
    """slim.learning.train's loop: a Supervisor's managed session running
    [train_op, global_step]; returns the watched values after each step and
    the losses the loop logs."""
    supervisor = tf1.train.Supervisor(
        logdir=None, global_step=global_step, summary_op=None, saver=None)
    values, losses = [], []
    with supervisor.managed_session("", config=_config()) as sess:
      values.append(sess.run(watched))
      for step in range(3):
        feed = {x: _batch(step * 2 + i) for i, x in enumerate(inputs)}
        if step == nan_step:
          feed[inputs[0]] = _batch(0, nan=True)  # a fault in clone 0
        total_loss, _ = sess.run([train_tensor, global_step], feed)
        losses.append(total_loss)
        values.append(sess.run(watched))
      counters = sess.run(counters_lib.skip_counters())
    return values, losses, counters

  def testOneLineIsToldAtTheFirstRunNamingTheVariables(self):
    with tf.Graph().as_default():
      built = self._build(protect=False)
      with self.assertLogs(level="WARNING") as logs:
        self._train(*built)
      told = _warnings(logs, "outside the skip decision")
      self.assertLen(told, 1, logs.output)
      for name in ("net/moving_mean", "net/weights/ExponentialMovingAverage",
                   "net/moving_mean/ExponentialMovingAverage"):
        self.assertIn(name, told[0])
      # In the script's words (issue 33, item 5): its names, not
      # `train_op = opt.protect(train_op)`.
      self.assertIn("`train_tensor = optimizer.protect(train_tensor)`",
                    told[0])

  def testStrictRefusesTheFirstRun(self):
    with tf.Graph().as_default():
      built = self._build(protect=False, strict=True)
      with self.assertRaisesRegex(ValueError, "outside the skip decision"):
        self._train(*built)

  def testProtectedTrainTensorKeepsEverythingOnASkip(self):
    with tf.Graph().as_default():
      built = self._build(protect=True, strict=True)  # strict: clean
      values, losses, counters = self._train(*built, nan_step=1)
    self.assertEqual((2, 1), (counters.applied_steps, counters.skipped_steps))
    before, after_skip, after = values[1], values[2], values[3]
    for kept, was in zip(after_skip, before):
      self.assertAllEqual(was, kept)  # bit-identical on the skip
    for moved, was in zip(after, after_skip):
      self.assertTrue(np.isfinite(moved).all())
      self.assertFalse(np.array_equal(moved, was))
    # A tensor stays a tensor: the loop logs the loss it returns.
    self.assertTrue(np.isfinite(losses[0]))


class DistributedOptimizer(tf1.train.Optimizer):
  """Like Horovod's `hvd.DistributedOptimizer(opt)`: wraps an optimizer
  (its `_optimizer`), averages the gradients, lets it apply them."""

  def __init__(self, optimizer):
    super().__init__(use_locking=False, name="Distributed")
    self._optimizer = optimizer

  def compute_gradients(self, *args, **kwargs):
    return self._optimizer.compute_gradients(*args, **kwargs)  # allreduce

  def apply_gradients(self, *args, **kwargs):
    return self._optimizer.apply_gradients(*args, **kwargs)


class HorovodWrapsTheWrapperTest(tf.test.TestCase):
  """Issue 33, item 5: another optimizer wraps ours; advice names it and
  what holds `protect`, and followed literally it does not loop."""

  def testAdviceNamesTheWrappingClassAndWhatHoldsProtect(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [4, 3])
      loss = _net(x, "hvd")
      global_step = tf1.train.get_or_create_global_step()
      opt = tf1.train.MomentumOptimizer(0.1, momentum=0.9)
      opt = optimizer_lib.SkipNonFiniteOptimizer(opt, strict=True)
      opt = DistributedOptimizer(opt)  # Horovod's line
      train_op = opt.minimize(loss, global_step=global_step)
      ema = tf1.train.ExponentialMovingAverage(0.99)
      train_op = tf.group(train_op, ema.apply(tf1.trainable_variables()))
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        with self.assertRaisesRegex(ValueError,
                                    "outside the skip decision") as refused:
          sess.run(train_op, {x: _batch(0)})
        told = str(refused.exception)
        self.assertIn("`train_op = opt._optimizer.protect(train_op)` "
                      "(protect is the SkipNonFiniteOptimizer's, which your "
                      "DistributedOptimizer wraps", told)
        self.assertNotIn("group_deps", told)
        names = {"opt": opt, "train_op": train_op}
        exec("train_op = opt._optimizer.protect(train_op)", {}, names)  # pylint: disable=exec-used
        sess.run(tf1.global_variables_initializer())
        sess.run(names["train_op"], {x: _batch(0)})  # Not refused.


class _IgnoresGlobalStep(tf1.train.GradientDescentOptimizer):
  """Like BERT's optimizer: apply_gradients takes global_step, ignores it."""

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del global_step  # The script advances it itself.
    return super().apply_gradients(grads_and_vars, name=name)


class BertCreateOptimizerTest(tf.test.TestCase):
  """Its own global_step increment, grouped with the train op."""

  def _build(self, pass_global_step, strict=False):
    x = tf1.placeholder(tf.float32, [4, 3])
    loss = _net(x, "bert")
    global_step = tf1.train.get_or_create_global_step()
    learning_rate = tf1.train.polynomial_decay(
        0.1, global_step, 100, end_learning_rate=0.0, power=1.0)
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        _IgnoresGlobalStep(learning_rate), strict=strict)
    tvars = tf1.trainable_variables()
    grads = tf.gradients(loss, tvars)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
    if pass_global_step:
      train_op = opt.apply_gradients(zip(grads, tvars),
                                     global_step=global_step)
    else:  # the line the warning says
      train_op = opt.apply_gradients(zip(grads, tvars))
    new_global_step = global_step + 1
    train_op = tf.group(train_op, [global_step.assign(new_global_step)])
    return x, train_op, global_step

  def _train(self, x, train_op, global_step):
    with tf1.train.MonitoredTrainingSession() as sess:
      for step in range(3):
        sess.run(train_op, {x: _batch(step, nan=step == 1)})
      return sess.run([global_step, counters_lib.skip_counters()])

  def testOneLineIsToldGlobalStepAdvancesTwice(self):
    with tf.Graph().as_default():
      built = self._build(pass_global_step=True)
      with self.assertLogs(level="WARNING") as logs:
        step, _ = self._train(*built)
      self.assertEqual(6, step)  # what the warning is about
      told = _warnings(logs, "advanced twice per step")
      self.assertLen(told, 1, logs.output)
      self.assertIn("global_step is advanced twice", told[0])
      self.assertIn("Assign", told[0])  # the script's increment, named
      self.assertIn("`opt.apply_gradients(grads_and_vars)` without "
                    "global_step=", told[0])

  def testStrictRefusesTheFirstRun(self):
    with tf.Graph().as_default():
      built = self._build(pass_global_step=True, strict=True)
      with self.assertRaisesRegex(ValueError, "advanced twice per step"):
        self._train(*built)

  def testAdvisedLineAdvancesOncePerStep(self):
    with tf.Graph().as_default():
      built = self._build(pass_global_step=False, strict=True)
      step, counters = self._train(*built)
    self.assertEqual(3, step)  # skipped steps count, as the policy says
    self.assertEqual((2, 1), (counters.applied_steps, counters.skipped_steps))


class TfCnnBenchmarksReplicatedTest(tf.test.TestCase):
  """One optimizer per device, each applying once, grouped with tower 0's
  update ops; the script advances global_step itself."""

  def _build(self, per_device, strict=False):
    inputs, grads, variables = [], [], []
    for i, device in enumerate(_DEVICES):
      with tf.device(device), tf1.variable_scope("v%d" % i):
        x = tf1.placeholder(tf.float32, [4, 3])
        loss = _net(x, "tower_%d" % i)
        tvars = [v for v in tf1.trainable_variables()
                 if v.op.name.startswith("v%d/" % i)]
        inputs.append(x)
        variables.append(tvars)
        grads.append(tf.gradients(loss, tvars))
    # All-reduce: every device gets the sum.
    summed = [tf.add_n(list(g)) for g in zip(*grads)]
    optimizers = [tf1.train.MomentumOptimizer(0.1, momentum=0.9)
                  for _ in _DEVICES]
    pairs = [list(zip(summed, tvars)) for tvars in variables]
    if per_device:  # the line the warning says
      opt = optimizer_lib.SkipNonFiniteOptimizer(optimizers[0], strict=strict)
      training_ops = [opt.apply_gradients_per_device(pairs,
                                                     optimizers=optimizers)]
    else:
      training_ops = []
      for opt, device_pairs in zip(optimizers, pairs):
        opt = optimizer_lib.SkipNonFiniteOptimizer(opt, strict=strict)
        training_ops.append(opt.apply_gradients(device_pairs))
    update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "v0")
    train_op = tf.group(*(training_ops + update_ops))
    if per_device:
      train_op = opt.protect(train_op)  # and the line for update_ops
    global_step = tf1.train.get_or_create_global_step()
    with tf1.control_dependencies([train_op]):
      inc_global_step = global_step.assign_add(1)
    fetches = {"train_op": train_op, "inc_global_step": inc_global_step}
    return inputs, fetches, variables

  def _train(self, inputs, fetches, variables):
    with tf1.Session(config=_config()) as sess:
      sess.run(tf1.global_variables_initializer())
      for step in range(3):
        feed = {x: _batch(step + i) for i, x in enumerate(inputs)}
        if step == 1:
          feed[inputs[1]] = _batch(0, nan=True)
        sess.run(fetches, feed)
      return sess.run([counters_lib.skip_counters(), variables])

  def testOneLineIsToldNamingApplyGradientsPerDevice(self):
    with tf.Graph().as_default():
      built = self._build(per_device=False)
      with self.assertLogs(level="WARNING") as logs:
        counters, _ = self._train(*built)
      self.assertEqual((4, 2), (counters.applied_steps,
                                counters.skipped_steps))  # counted twice
      told = _warnings(logs, "executes 2 guarded steps")
      self.assertLen(told, 1, logs.output)
      self.assertIn("opt.apply_gradients_per_device(", told[0])

  def testStrictRefusesTheFirstRun(self):
    with tf.Graph().as_default():
      built = self._build(per_device=False, strict=True)
      with self.assertRaisesRegex(ValueError, "executes 2 guarded steps"):
        self._train(*built)

  def testAdvisedLinesCountOnceAndKeepTheCopiesEqual(self):
    with tf.Graph().as_default():
      built = self._build(per_device=True, strict=True)  # strict: clean
      counters, (copy0, copy1) = self._train(*built)
    self.assertEqual((2, 1), (counters.applied_steps, counters.skipped_steps))
    for a, b in zip(copy0, copy1):
      self.assertAllEqual(a, b)


if __name__ == "__main__":
  tf.test.main()
