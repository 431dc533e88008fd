"""An fp16 small_cnn run of 150 steps trains, with its loss scale.

On this project's CPU float16 convolutions run on oneDNN's reference kernels,
about 100x slower than float32 (see docs/mixed_precision.md): at 32x32 a
few hundred steps would take most of an hour. The run below is the real
trainer (`train_lib.train`, small_cnn, `--precision=fp16`, dynamic loss
scale) on the embedded synthetic data shrunk to 8x8 images, which keeps the
arithmetic and takes a few CPU seconds (150 steps: the loss falls by a
third, the scale halves and grows; 300 steps proved nothing more). The scale
starts too large, so the first steps overflow float16 for certain: they are
skipped, the scale halves until the gradients fit, and it grows again after
good steps. A resume of that run (on a copy) with --loss_scale_hysteresis=2
and drilled overflows shows the hysteresis.
"""

import os
import shutil
import tempfile

from absl import logging
import numpy as np
import tensorflow as tf

from tests.fixtures import run_logs
from tests.fixtures import train_dirs
from tf1_safe_train import data
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_IMAGE_SIZE = 8
_STEPS = 150
_GROWTH_STEPS = 25
_SUMMARY_STEPS = 5  # The loss and scale every 5 steps: 30 values.
# The logits' gradient is up to 1/batch = 1/8 per element: times 2**20 it is
# 131072, beyond float16's maximum (65504).
_INITIAL_SCALE = 2.0**20


def _shrunk_dataset(batch_size, seed):
  """The synthetic training batches, images shrunk to _IMAGE_SIZE squared."""
  return data.get_dataset("synthetic", "train", batch_size, seed=seed).map(
      lambda images, labels: (tf.image.resize(
          images, [_IMAGE_SIZE, _IMAGE_SIZE], method="area"), labels))


def _params(train_dir):
  return params_lib.TrainParams(
      train_dir=train_dir, model="small_cnn", num_towers=1, device="cpu",
      batch_size=8, max_steps=_STEPS, precision="fp16",
      initial_loss_scale=_INITIAL_SCALE,
      loss_scale_growth_steps=_GROWTH_STEPS,
      save_summaries_steps=_SUMMARY_STEPS,
      save_checkpoints_steps=100000, log_every_n_steps=100).validate()


class Float16TrainingTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One run: it trains (below), and its checkpoint (no hysteresis) is the
    # one the hysteresis test resumes, on a copy.
    cls.train_dir = os.path.join(
        tempfile.mkdtemp(dir=tf1.test.get_temp_dir()), "fp16")
    cls.params = _params(cls.train_dir)
    with run_logs.capture(logging.get_absl_logger(), "INFO") as logs:
      cls.summary = train_lib.train(cls.params, dataset_fn=_shrunk_dataset)
    cls.logs = logs

  def testSmallCnnTrainsInFloat16WithDynamicLossScale(self):
    train_dir, summary, logs = self.train_dir, self.summary, self.logs
    self.assertEqual("max_steps", summary["exit_reason"])
    self.assertEqual(_STEPS, summary["global_step"])
    self.assertEqual(_STEPS,
                     summary["applied_steps"] + summary["skipped_steps"])
    # The first step overflows; a few halvings later the gradients fit, and
    # later overflows (after growths) are single skips.
    self.assertGreaterEqual(summary["skipped_steps"], 1)
    self.assertLess(summary["skipped_steps"], _STEPS // 10)
    self.assertLessEqual(summary["max_consecutive_skips_seen"], 10)
    skip_reports = [r.getMessage() for r in logs.records
                    if "skipped step" in r.getMessage()]
    self.assertLen(skip_reports, summary["skipped_steps"])
    self.assertIn("skipped step 0:", skip_reports[0])
    self.assertIn("loss-scale overflow at scale 1048576", skip_reports[0])
    for report in skip_reports:
      self.assertIn("loss-scale overflow", report)
      self.assertNotIn("real fault", report)

    # The loss falls: ln(10) = 2.30 is chance for 10 classes.
    losses = [v for _, v in train_dirs.scalars(train_dir, "loss")]
    self.assertLen(losses, _STEPS // _SUMMARY_STEPS)
    first, last = np.mean(losses[:3]), np.mean(losses[-10:])
    self.assertGreater(first, 2.0)
    self.assertLess(last, 0.75 * first, losses)

    # The scale moved (grew after good runs, halved on overflows), stayed a
    # power of two >= 1, and the checkpoint holds the run summary's value.
    scales = [v for _, v in train_dirs.scalars(train_dir, "loss_scale")]
    self.assertLess(scales[0], _INITIAL_SCALE, scales)
    self.assertTrue(any(b > a for a, b in zip(scales, scales[1:])), scales)
    for scale in scales + [summary["loss_scale"]]:
      self.assertGreaterEqual(scale, 1.0)
      self.assertEqual(scale, 2.0**round(np.log2(scale)))
    reader = tf1.train.load_checkpoint(tf1.train.latest_checkpoint(train_dir))
    self.assertEqual(summary["loss_scale"],
                     reader.get_tensor("loss_scale/scale"))
    # Master weights are float32 and finite.
    for name, dtype in reader.get_variable_to_dtype_map().items():
      if dtype.is_floating:
        self.assertNotEqual(tf.float16, dtype, name)
        self.assertTrue(np.isfinite(reader.get_tensor(name)).all(), name)

  def testResumedWithHysteresisTheSecondOverflowInARowHalves(self):
    # The run above has no hysteresis: its checkpoint lacks the streak,
    # which the resumed run starts at 0. There the drill's NaN gradients
    # are overflows: step 150 alone keeps the scale, step 151 applies
    # (ending the streak), and steps 152 and 153 in a row halve it once.
    # Without the reset it would halve at 152 and 153; without hysteresis,
    # three times. (The run's last natural overflow is at step 140, at
    # twice the scale it ends with; its next growth would come at 165.)
    first = self.summary
    train_dir = os.path.join(self.get_temp_dir(), "hysteresis")
    shutil.copytree(self.train_dir, train_dir)
    summary = train_lib.train(
        self.params.replace(train_dir=train_dir, max_steps=_STEPS + 4,
                            loss_scale_hysteresis=2, max_explained_skips=0,
                            inject_nonfinite="nan@%d,nan@%d-%d" % (
                                _STEPS, _STEPS + 2, _STEPS + 3)),
        dataset_fn=_shrunk_dataset)
    self.assertEqual((first["applied_steps"] + 1, first["skipped_steps"] + 3,
                      first["loss_scale"] / 2),
                     (summary["applied_steps"], summary["skipped_steps"],
                      summary["loss_scale"]))
    reader = tf1.train.load_checkpoint(tf1.train.latest_checkpoint(train_dir))
    self.assertEqual(2, reader.get_tensor("loss_scale/overflow_streak"))


if __name__ == "__main__":
  tf.test.main()
