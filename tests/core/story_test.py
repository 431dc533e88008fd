"""The wrapper's report hook says what it guards and what the run did.

Issue #37: a start line and a final line on every run, //:train's and the
wrapper's `report_hook` alike, in the same words where they mean the same.
"""

import os
import re

import tensorflow as tf

from tests.fixtures import tiny_model as test_util
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.run import run_story

tf1 = tf.compat.v1

_DEVICES = ["/device:CPU:0", "/device:CPU:1"]
_BATCHES = (test_util.GOOD_X, test_util.NAN_X, test_util.GOOD_X2,
            test_util.GOOD_X)


def _run(hook_fn, opt_kwargs=None, towers=False):
  """Runs `_BATCHES` through a MonitoredTrainingSession with the hook
  `hook_fn(opt)`; returns (the hook, the INFO lines logged)."""
  with tf.Graph().as_default():
    global_step = tf1.train.get_or_create_global_step()
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.GradientDescentOptimizer(0.1), **(opt_kwargs or {}))
    if towers:
      inputs, tower_grads = [], []
      for i, device in enumerate(_DEVICES):
        with tf.device(device):
          x = tf1.placeholder(tf.float32, [3], name="x%d" % i)
          with tf1.variable_scope("", reuse=tf1.AUTO_REUSE):
            loss, var_list = test_util.model(x)
          tower_grads.append(list(zip(tf.gradients(loss, var_list),
                                      var_list)))
        inputs.append(x)
      average = [(tf.add_n([g[j][0] for g in tower_grads]) / 2.0,
                  tower_grads[0][j][1]) for j in range(len(var_list))]
      train_op = opt.apply_gradients(average, global_step,
                                     tower_grads_and_vars=tower_grads)
    else:
      x = tf1.placeholder(tf.float32, [3])
      inputs = [x]
      loss, _ = test_util.model(x)
      train_op = opt.minimize(loss, global_step=global_step)
    hook = hook_fn(opt)
    config = tf1.ConfigProto(device_count={"CPU": 2})
    # INFO: the run's lines; the skip line is a WARNING.
    with tf.test.TestCase().assertLogs(level="INFO") as logs:
      with tf1.train.MonitoredTrainingSession(hooks=[hook],
                                              config=config) as sess:
        for batch in _BATCHES:
          sess.run(train_op, {x: batch for x in inputs})
  return hook, [r.getMessage() for r in logs.records]


class WrapperStoryLinesTest(tf.test.TestCase):

  def testTheHookSaysWhatItGuardsAndWhatTheRunDid(self):
    path = skip_log.path(self.get_temp_dir(), 0)
    _, lines = _run(lambda opt: opt.report_hook(skip_log_path=path,
                                                batch_size=3),
                    {"loss_scale": "dynamic"})
    start = [l for l in lines if l.startswith("skip guard: ")]
    self.assertEqual(start, [
        "skip guard: skip when gradients, loss or statistics hold NaN/Inf; "
        "loss scale dynamic from 32768; towers not given "
        "(tower_grads_and_vars=); skip records: %s" % path])
    final = [l for l in lines if l.startswith("run ended")]
    self.assertLen(final, 1)
    self.assertRegex(final[0], r"^run ended: 4 steps run, applied 3, "
                     r"skipped 1 \(nonfinite 1\), total examples/sec "
                     r"[0-9.]+, wall [0-9.]+ s; skip records: %s$"
                     % re.escape(path))
    # The start line before the skip's, the final line after it.
    skip = next(i for i, l in enumerate(lines)
                if l.startswith("skipped step 1"))
    self.assertLess(lines.index(start[0]), skip)
    self.assertGreater(lines.index(final[0]), skip)
    self.assertTrue(os.path.exists(path))

  def testTowersAndStepsPerSecondWithoutABatchSize(self):
    hook, lines = _run(lambda opt: opt.report_hook(), towers=True)
    self.assertIn(
        "skip guard: skip when gradients, loss or statistics hold NaN/Inf; "
        "loss scale none; towers 2 (/device:CPU:0, /device:CPU:1)", lines)
    self.assertRegex(hook.story.final_line,
                     r"^run ended: 4 steps run, applied 3, skipped 1 "
                     r"\(nonfinite 1\), total steps/sec [0-9.]+, "
                     r"wall [0-9.]+ s$")
    self.assertIn(hook.story.final_line, lines)

  def testTheFinalLineHasTheTrainersWords(self):
    hook, _ = _run(lambda opt: opt.report_hook(batch_size=3))
    trainers = run_story.summary_line({
        "global_step": 4, "exit_reason": "max_steps", "steps_this_run": 4,
        "applied_steps": 3, "skipped_steps": 1,
        "skips_by_reason": {"nonfinite": 1}, "final_loss": 1.0,
        "examples_per_sec": 12.5, "wall_seconds": 2.0}, "/tmp/run")
    shared = "4 steps run, applied 3, skipped 1 (nonfinite 1)"
    self.assertIn(shared, trainers)
    self.assertIn(shared, hook.story.final_line)
    for words in ("total examples/sec ", " s; "):
      self.assertIn(words, trainers)
    self.assertIn("total examples/sec ", hook.story.final_line)
    self.assertRegex(trainers, r", wall [0-9.]+ s; ")
    self.assertRegex(hook.story.final_line, r", wall [0-9.]+ s$")


if __name__ == "__main__":
  tf.test.main()
