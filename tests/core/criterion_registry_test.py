"""A criterion of a temporary module, registered with one line, is seen
everywhere a built-in one is: `//:train`'s flag declarations and --help,
the early check (no TensorFlow), the log line, skips.jsonl, TensorBoard,
run_summary.json, forensics, and the wrapper's keyword.
"""

import importlib
import json
import os
import sys
import textwrap
from unittest import mock

from absl import logging
import numpy as np
import tensorflow as tf

from tests.fixtures import event_files
from tests.fixtures import forensics_params
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.core import criterion_registry
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.config import flag_groups
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.explain import forensics
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

# The spec (no TensorFlow) and the criterion, as a newcomer writes them.
_SPEC_MODULE = '''
from tf1_safe_train.core import criterion_spec

FLAG = "skip_loss_above"


def check(params):
  criterion_spec.require_finite_at_least_zero(FLAG, getattr(params, FLAG))


SPEC = criterion_spec.CriterionSpec(
    reason="loss_ceiling",
    flags=(criterion_spec.Flag(FLAG, 0.0, "Skip a step whose loss (or a "
                               "tower's) exceeds this; 0 = off."),),
    group="A loss ceiling",
    check=check,
    config=lambda params: getattr(params, FLAG) or None,
    criterion="registry_test_loss_ceiling:LossCeiling")
'''
_CRITERION_MODULE = '''
import tensorflow as tf

from tf1_safe_train.core import criteria


class LossCeiling(criteria.Criterion):
  reason = "loss_ceiling"

  def __init__(self, threshold):
    self.threshold = float(threshold)

  def decide(self, context):
    towers = context.towers
    loss = (tf.reduce_max(towers["loss"]) if "loss" in towers
            else context.loss)
    loss = tf.cast(loss, tf.float32)
    threshold = tf.constant(self.threshold)
    flag = tf.logical_and(loss > threshold, tf.logical_not(context.nonfinite))
    return flag, {"loss": loss, "threshold": threshold}

  def describe(self, values):
    return "loss %.4g > threshold %.4g" % (values["loss"], values["threshold"])
'''


class RegisteredCriterionTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    folder = os.path.join(self.get_temp_dir(), "modules")
    os.makedirs(folder, exist_ok=True)
    for name, text in (("registry_test_loss_ceiling_spec", _SPEC_MODULE),
                       ("registry_test_loss_ceiling", _CRITERION_MODULE)):
      with open(os.path.join(folder, name + ".py"), "w") as f:
        f.write(textwrap.dedent(text))
    sys.path.insert(0, folder)
    self.addCleanup(sys.path.remove, folder)
    # The one line.
    spec = criterion_registry.register("registry_test_loss_ceiling_spec")
    self.addCleanup(criterion_registry.unregister, spec)

  def testItsFlagIsDeclaredAndCheckedEarly(self):
    # What train.py defines (at its import: a library criterion's spec is
    # registered by then) and lists by concept in its --help.
    specs = (flag_specs.of_params(params_lib.TrainParams) +
             cluster_flags.FLAGS)
    (declared,) = [s for s in specs if s.name == "skip_loss_above"]
    self.assertEqual((declared.kind, declared.default), ("float", 0.0))
    self.assertIn("A loss ceiling:\n  --skip_loss_above: Skip a step",
                  flag_groups.help_text(specs))
    # The early check runs without TensorFlow: the spec imports none.
    del sys.modules["registry_test_loss_ceiling_spec"]
    blocked = dict(sys.modules, tensorflow=None)
    with mock.patch.dict(sys.modules, blocked, clear=True):
      spec_module = importlib.import_module("registry_test_loss_ceiling_spec")
      with self.assertRaisesRegex(ValueError,
                                  r"--skip_loss_above=-1\.0: must be a "
                                  r"finite number >= 0"):
        spec_module.check(params_lib.TrainParams(skip_loss_above=-1.0))
    with self.assertRaisesRegex(params_lib.ParamsError, "skip_loss_above"):
      params_lib.TrainParams(skip_loss_above=-1.0).validate()

  def testTheTrainerSkipsReportsAndCountsIt(self):
    train_dir = os.path.join(self.get_temp_dir(), "trainer")
    # Tower 1's loss x 1e3 at step 2 (finite): only the criterion skips it.
    params = forensics_params.params(
        train_dir, inject_nonfinite="scale1e3@2:1", inject_into="loss",
        save_summaries_steps=1, skip_loss_above=100.0)
    with self.assertLogs(logging.get_absl_logger(), "WARNING") as logs:
      summary = train_lib.train(params)
    self.assertEqual(summary["skips_by_reason"],
                     {"nonfinite": 0, "loss_ceiling": 1})
    with open(os.path.join(train_dir, "run_summary.json")) as f:
      self.assertEqual(json.load(f)["skips_by_reason"],
                       {"nonfinite": 0, "loss_ceiling": 1})
    lines = [r.getMessage() for r in logs.records
             if "skipped step" in r.getMessage()]
    self.assertLen(lines, 1)
    self.assertRegex(lines[0], r"^skipped step 2: loss_ceiling, loss \S+ > "
                     r"threshold 100$")
    (record,) = skip_log.read(skip_log.path(train_dir))
    self.assertEqual((record["step"], record["reason"], record["verdict"]),
                     (2, "loss_ceiling", forensics.FINITE % "loss_ceiling"))
    self.assertGreater(record["loss_ceiling"]["loss"], 100.0)
    self.assertEqual(summary["forensics"]["verdicts"], {"loss_ceiling": 1})
    self.assertEqual(event_files.last_scalars(train_dir, "skips/loss_ceiling")[
        "skips/loss_ceiling_skips"], 1.0)

  def testTheWrapperTakesItsKeyword(self):
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [3])
      w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0, 3.0]))
      opt = optimizer_lib.SkipNonFiniteOptimizer(
          tf1.train.GradientDescentOptimizer(0.1), skip_loss_above=10.0)
      train_op = opt.minimize(tf.reduce_sum(x * w))
      counts = opt.guard_result().reasons.counts
      hook = opt.report_hook()
      with tf1.train.SingularMonitoredSession(hooks=[hook]) as sess:
        sess.run(train_op, {x: np.full(3, 0.1, np.float32)})
        before = sess.run(w)
        _, after = sess.run([train_op, counts],
                            {x: np.full(3, 5.0, np.float32)})
        self.assertAllEqual(before, sess.run(w))
        self.assertEqual(after, {"nonfinite_skips": 0,
                                 "loss_ceiling_skips": 1})
    self.assertRegex(hook.reports[0], r"^skipped step 1: loss_ceiling, loss "
                     r"\S+ > threshold 10$")


if __name__ == "__main__":
  tf.test.main()
