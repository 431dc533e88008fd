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
And tf-slim itself (1.1.0) on TF 2.21, which needs `patch_tf_slim()`.
Stacked with loss scaling: a script's AMP line after the wrapper line
(TF's dynamic loss-scale optimizer around the wrapper) is refused at graph
build, and tf_cnn_benchmarks' `--fp16_enable_auto_loss_scale` cond around
the apply is told; with the lines they say, each is clean.
"""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tests.fixtures import forked_python
from tests.fixtures import tiny_model as test_util
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


# A tf-slim model, run in a fresh process: `arg_scope`, `conv2d` with the
# default batch norm (Keras 2's legacy layer, UPDATE_OPS), an in-place
# batch norm with a tensor `is_training` (`ops.Tensor`, a cond), the wrapper
# under `slim.learning.create_train_op`; one applied step, one skipped (a NaN
# input), then `slim.learning.train`'s own loop. PATCH is set in front.
_SLIM_MODEL = """
import tempfile
import numpy as np
import tensorflow as tf
import tf1_safe_train
if PATCH:
  print("patched", tf1_safe_train.patch_tf_slim())
  print("again", tf1_safe_train.patch_tf_slim())
import tf_slim as slim

tf1 = tf.compat.v1
tf1.disable_eager_execution()
x = tf1.placeholder_with_default(np.ones([4, 6, 6, 1], np.float32),
                                 [None, 6, 6, 1])
training = tf1.placeholder_with_default(True, [])
with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm,
                    normalizer_params={"is_training": True}):
  net = slim.conv2d(x, 2, [3, 3], scope="conv1")
net = slim.batch_norm(net, updates_collections=None, is_training=training,
                      scope="in_place")
logits = slim.fully_connected(slim.flatten(net), 3, activation_fn=None)
loss = tf1.losses.sparse_softmax_cross_entropy(tf.zeros([4], tf.int64), logits)
opt = tf1_safe_train.SkipNonFiniteOptimizer(tf1.train.MomentumOptimizer(0.1, 0.9))
train_op = slim.learning.create_train_op(loss, opt, check_numerics=False)
with tf1.Session() as sess:
  sess.run(tf1.global_variables_initializer())
  sess.run(train_op)
  before = sess.run(tf1.model_variables())
  sess.run(train_op, {x: np.full([4, 6, 6, 1], np.nan, np.float32)})
  after = sess.run(tf1.model_variables())
print("statistics", len([v for v in tf1.model_variables() if "moving" in v.name]),
      "unchanged by the skip", all(map(np.array_equal, before, after)))
last = slim.learning.train(train_op, tempfile.mkdtemp(), number_of_steps=4,
                           save_summaries_secs=None, save_interval_secs=None)
print("slim.learning.train's last loss finite", np.isfinite(last))
"""


class TfSlimTest(tf.test.TestCase):
  """tf-slim 1.1.0 on TF 2.21: `tf1_safe_train.patch_tf_slim()` (issue 33)."""

  def _run(self, patch):
    return forked_python.run_shared("PATCH = %s\n%s" % (patch, _SLIM_MODEL),
                                    self.get_temp_dir())

  def testTfSlimFailsWithoutThePatch(self):
    result = self._run(patch=False)
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("No module named 'tf_keras.legacy_tf_layers'", result.stderr)

  def testPatchedTfSlimTrainsAndSkips(self):
    result = self._run(patch=True)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn(
        "patched ['control_flow_ops.Assert', 'control_flow_ops.case', "
        "'control_flow_ops.cond', 'control_flow_ops.while_loop', 'ops.Tensor', "
        "'tf_keras.legacy_tf_layers'", result.stdout)
    self.assertIn("again []", result.stdout)
    # Both batch norms' moving mean and variance, and every weight.
    self.assertIn("statistics 4 unchanged by the skip True", result.stdout)
    self.assertIn("slim.learning.train's last loss finite True", result.stdout)

  def testTheInPlaceBatchNormFailsWithoutThePatchToo(self):
    # Without the Keras layer (an in-place batch norm alone): ops.Tensor.
    code = _SLIM_MODEL.replace("  net = slim.conv2d(x, 2, [3, 3], scope=\"conv1\")",
                               "  net = x")
    result = forked_python.run_shared("PATCH = False\n" + code,
                                      self.get_temp_dir())
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("has no attribute 'Tensor'", result.stderr)

  def testWithoutTfKerasSaysWhatToInstall(self):
    # Loading the name imports neither tf_keras nor tf_slim; the call does.
    result = forked_python.run_shared(
        "import sys\n"
        "sys.modules['tf_keras'] = None  # as if not installed\n"
        "import tf1_safe_train\n"
        "patch = tf1_safe_train.patch_tf_slim\n"
        "print('loaded', 'tf_slim' in sys.modules)\n"
        "patch()\n", self.get_temp_dir())
    self.assertIn("loaded False", result.stdout)
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("ImportError: patch_tf_slim needs tf-keras", result.stderr)


def tearDownModule():
  forked_python.close_shared()
# TF1 scripts' v1 conds over ref variables, and TF2's defaults.
_CONFIGS = [("CondV2", {}),
            ("CondV1", {"control_flow_v2": False,
                        "resource_variables": False})]


def _amp(kind, opt):
  """The script's AMP line: TF's dynamic loss-scale optimizer around `opt`."""
  if kind == "graph_rewrite":
    return tf1.mixed_precision.enable_mixed_precision_graph_rewrite(opt)
  return tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(opt, "dynamic")


class AutomaticMixedPrecisionTest(tf.test.TestCase, parameterized.TestCase):
  """A script's AMP line and an EMA, with the wrapper line before or after
  the AMP line; update ops as control dependencies of minimize."""

  def _build(self, kind, wrapper_first):
    if kind == "graph_rewrite":  # Process-wide: later graphs must not have it.
      self.addCleanup(tf1.mixed_precision.disable_mixed_precision_graph_rewrite)
    x = tf1.placeholder(tf.float32, [4, 3])
    loss = _net(x, "amp")
    global_step = tf1.train.get_or_create_global_step()
    opt = tf1.train.MomentumOptimizer(0.1, momentum=0.9)
    if wrapper_first:  # the wrapper line where the migration put it
      opt = optimizer_lib.SkipNonFiniteOptimizer(opt, strict=True)
      opt = _amp(kind, opt)
    else:  # the order the refusal says
      opt = _amp(kind, opt)
      opt = optimizer_lib.SkipNonFiniteOptimizer(opt, strict=True)
    with tf1.control_dependencies(tf1.get_collection(
        tf1.GraphKeys.UPDATE_OPS)):
      train_op = opt.minimize(loss, global_step=global_step)
    ema = tf1.train.ExponentialMovingAverage(0.99)
    with tf1.control_dependencies([train_op]):
      train_op = tf.group(ema.apply(tf1.trainable_variables()))
    train_op = opt.protect(train_op)  # the first run's line
    return x, train_op, global_step

  @parameterized.parameters("graph_rewrite", "loss_scale_optimizer")
  def testWrapperInsideTheLossScaleOptimizerIsRefusedAtBuild(self, kind):
    for config_name, config in _CONFIGS:
      with self.subTest(config_name), test_util.tf_config(**config), \
          tf.Graph().as_default():
        with self.assertRaisesRegex(
            ValueError, r"skips a step with non-finite gradients without "
            r"calling it(.|\n)*Wrap in the other order"):
          self._build(kind, wrapper_first=True)

  @parameterized.parameters("graph_rewrite", "loss_scale_optimizer")
  def testAdvisedOrderSkipsCountsAndHalvesTheScale(self, kind):
    for config_name, config in _CONFIGS:
      with self.subTest(config_name), test_util.tf_config(**config):
        self._checkAdvisedOrder(kind)

  def _checkAdvisedOrder(self, kind):
    with tf.Graph().as_default():
      x, train_op, global_step = self._build(kind, wrapper_first=False)
      scale = [v for v in tf1.global_variables()
               if v.op.name == "current_loss_scale"]
      watched = [v for v in tf1.global_variables()
                 if "skip_shadow" not in v.op.name and v not in scale and
                 v.dtype.base_dtype == tf.float32]
      values, scales = [], []
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(3):
          values.append(sess.run(watched))
          scales.append(sess.run(scale))
          sess.run(train_op, {x: _batch(step, nan=step == 1)})
        counters = sess.run(counters_lib.skip_counters())
        self.assertEqual(3, sess.run(global_step))  # the policy: each step
    self.assertEqual(["net/weights", "net/moving_mean", "net/weights/Momentum",
                      "net/weights/ExponentialMovingAverage"],
                     [v.op.name for v in watched])
    self.assertEqual((2, 1), (counters.applied_steps, counters.skipped_steps))
    after_skip = values[2]
    for name, kept, was in zip([v.op.name for v in watched], after_skip,
                               values[1]):
      self.assertAllEqual(was, kept, msg=name)  # bit-identical on the skip
    self.assertEqual([[2.0**15], [2.0**15], [2.0**14]], scales)


class TfCnnBenchmarksAutoLossScaleTest(tf.test.TestCase):
  """The script's own loss scale: scaled loss, unscaled gradients, a cond
  on their finiteness that halves the scale or updates it and applies;
  tower 0's update ops grouped next to it, global_step advanced after."""

  def _build(self, apply_outside, strict=False, protect=None):
    x = tf1.placeholder(tf.float32, [4, 3])
    loss = _net(x, "tower_0")
    global_step = tf1.train.get_or_create_global_step()
    loss_scale = tf1.get_variable("loss_scale", initializer=128.0,
                                  trainable=False)
    normal_steps = tf1.get_variable("loss_scale_normal_steps", initializer=0,
                                    trainable=False)
    tvars = tf1.trainable_variables()
    grads = tf.gradients(loss * loss_scale, tvars)
    grads = [g * (1.0 / loss_scale) for g in grads]
    grad_has_inf_nan = tf.logical_not(tf.reduce_all(
        [tf.reduce_all(tf.math.is_finite(g)) for g in grads]))
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.MomentumOptimizer(0.1, momentum=0.9), strict=strict)

    def update_op_if_nan_or_inf():
      return tf.group(tf1.assign(loss_scale, loss_scale / 2.0),
                      tf1.assign(normal_steps, 0))

    def loss_scale_update_op():
      return tf.group(tf1.assign_add(normal_steps, 1))

    training_ops = []
    if apply_outside:  # the lines the build-time warning says
      training_ops.append(opt.apply_gradients(list(zip(grads, tvars))))
      training_ops.append(tf.cond(grad_has_inf_nan, update_op_if_nan_or_inf,
                                  loss_scale_update_op,
                                  name="cond_if_grad_has_inf_nan"))
    else:
      training_ops.append(tf.cond(
          grad_has_inf_nan, update_op_if_nan_or_inf,
          lambda: tf.group(loss_scale_update_op(),
                           opt.apply_gradients(list(zip(grads, tvars)))),
          name="cond_if_grad_has_inf_nan"))
    update_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS, "tower_0")
    train_op = tf.group(*(training_ops + update_ops))
    if apply_outside if protect is None else protect:
      train_op = opt.protect(train_op)  # the first run's line
    with tf1.control_dependencies([train_op]):
      inc_global_step = global_step.assign_add(1)
    fetches = {"train_op": train_op, "inc_global_step": inc_global_step}
    watched = [v for v in tf1.global_variables()
               if v.op.name.startswith("net/") and
               "skip_shadow" not in v.op.name] + [loss_scale]
    return x, fetches, watched

  def _train(self, x, fetches, watched):
    values = []
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for step in range(3):
        values.append(sess.run(watched))
        sess.run(fetches, {x: _batch(step, nan=step == 1)})
      return values, sess.run(counters_lib.skip_counters())

  def testApplyInsideTheCondIsToldAtBuild(self):
    for config_name, config in _CONFIGS:
      with self.subTest(config_name), test_util.tf_config(**config), \
          tf.Graph().as_default():
        with self.assertLogs(level="WARNING") as logs:
          self._build(apply_outside=False)
        told = _warnings(logs,
                         "inside the tf.cond 'cond_if_grad_has_inf_nan'")
        self.assertLen(told, 1, logs.output)
        self.assertIn("`apply_op = opt.apply_gradients(grads_and_vars)` "
                      "before the tf.cond", told[0])

  def testStrictRefusesAtBuild(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, "inside the tf.cond"):
        self._build(apply_outside=False, strict=True)

  def testProtectInsideTheCondIsRefusedAtBuild(self):
    # The first-run line without the build-time one: the rollback would read
    # a decision the cond did not run ("Retval[1] does not have value").
    for config_name, config in _CONFIGS:
      with self.subTest(config_name), test_util.tf_config(**config), \
          tf.Graph().as_default():
        with self.assertRaisesRegex(
            ValueError, "protect\\(\\) cannot undo writes next to a step "
            "built inside a tf.cond(.|\n)*cond_if_grad_has_inf_nan"):
          self._build(apply_outside=False, protect=True)

  def testAdvisedLinesSkipAndCountOnce(self):
    for config_name, config in _CONFIGS:
      with self.subTest(config_name), test_util.tf_config(**config):
        self._checkAdvisedLinesSkipAndCountOnce()

  def _checkAdvisedLinesSkipAndCountOnce(self):
    with tf.Graph().as_default():
      built = self._build(apply_outside=True, strict=True)  # strict: clean
      self.assertLen(built[2], 4)  # weights, Momentum, moving_mean; scale
      values, counters = self._train(*built)
    self.assertEqual((2, 1), (counters.applied_steps, counters.skipped_steps))
    for kept, was in zip(values[2][:3], values[1][:3]):
      self.assertAllEqual(was, kept)  # bit-identical on the skip
    # The script's scale halved on the skip (its cond), not rolled back.
    self.assertEqual([128.0, 128.0, 64.0], [v[3] for v in values])


if __name__ == "__main__":
  tf.test.main()
