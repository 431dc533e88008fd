"""`//:tensorboard` on a short run's train_dir serves the documented tags.

A few fp16 steps on 2 towers, one of them poisoned, written by the real
trainer; then TensorBoard (the README's command, on a free 127.0.0.1 port)
is asked through its HTTP API for the scalars `skips/skipped_steps`, the
per-tower counts and `loss_scale`, and the text `skips/explained`. And
issue #37's run: 20 steps at the default --save_summaries_steps, step 5
skipped, seen at the point stamped 6 and at the last step's.
"""

import importlib.util
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import tensorflow as tf

from tests.fixtures import tensorboard_server
from tf1_safe_train import data
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

_STEPS = 6
_POISONED_STEP = 3
# Issue #37's run: 20 steps, step 5 skipped, summaries at the default
# period (100): the skip counters are written on every change regardless.
_LONG_STEPS = 20
_LONG_POISONED_STEP = 5
_IMAGE_SIZE = 8  # fp16 convolutions are slow on CPU (fp16_train_test.py).
_WAIT_SECS = 90


def _shrunk_dataset(batch_size, seed):
  return data.get_dataset("synthetic", "train", batch_size, seed=seed).map(
      lambda images, labels: (tf.image.resize(
          images, [_IMAGE_SIZE, _IMAGE_SIZE], method="area"), labels))


def _points(port, tag):
  """{step: value} of the scalar `tag` (TensorBoard's [wall, step, value])."""
  return {step: value for _, step, value in _get(
      port, "/data/plugin/scalars/scalars", run=".", tag=tag)}


def _get(port, path, **query):
  url = "http://127.0.0.1:%d%s" % (port, path)
  if query:
    url += "?" + urllib.parse.urlencode(query)
  with urllib.request.urlopen(url, timeout=10) as response:
    return json.loads(response.read().decode())


class TensorBoardTest(tf.test.TestCase):

  def _train(self, train_dir):
    params = params_lib.TrainParams(
        train_dir=train_dir, model="small_cnn", num_towers=2, device="cpu",
        batch_size=4, max_steps=_STEPS, precision="fp16",
        initial_loss_scale=1.0, save_summaries_steps=1,
        save_checkpoints_steps=100000, log_every_n_steps=100,
        inject_nonfinite="nan@%d:1" % _POISONED_STEP).validate()
    summary = train_lib.train(params, dataset_fn=_shrunk_dataset)
    self.assertEqual(1, summary["skipped_steps"])

  def _start(self, train_dir):
    """TensorBoard on `train_dir`, and its port (read from its banner)."""
    process = tensorboard_server.start([
        "--logdir=" + train_dir, "--reload_interval=1", "--load_fast=false"])
    self.addCleanup(process.wait, timeout=30)
    self.addCleanup(process.kill)
    port, output = tensorboard_server.port(process, _WAIT_SECS)
    if port is None:
      self.fail("TensorBoard did not start (exit code %s):\n%s" % (
          process.poll(), output))
    return port

  def _wait_for_tags(self, port, plugin, wanted):
    """The tags of `plugin` once they include `wanted` (loaded in the back)."""
    deadline = time.monotonic() + _WAIT_SECS
    while True:
      try:
        tags = _get(port, "/data/plugin/%s/tags" % plugin).get(".", {})
      except urllib.error.URLError:
        tags = {}
      if set(wanted) <= set(tags) or time.monotonic() > deadline:
        return tags
      time.sleep(0.5)

  def testServesTheDocumentedTags(self):
    self.assertIsNotNone(
        importlib.util.find_spec("tensorboard"),
        "tensorboard is not installed in this Python: requirements.txt pins "
        "it, ./bazelw installs it")
    train_dir = os.path.join(self.get_temp_dir(), "run")
    self._train(train_dir)
    port = self._start(train_dir)

    scalars = ["loss", "learning_rate", "skips/applied_steps",
               "skips/skipped_steps", "skips/consecutive_skips",
               "skips/nonfinite_steps_tower_0",
               "skips/nonfinite_steps_tower_1", "skips/reproduced",
               "loss_scale"]
    self.assertContainsSubset(
        scalars, self._wait_for_tags(port, "scalars", scalars))
    self.assertContainsSubset(
        ["skips/explained"],
        self._wait_for_tags(port, "text", ["skips/explained"]))

    def last(tag):
      return _get(port, "/data/plugin/scalars/scalars", run=".", tag=tag)[-1]

    self.assertEqual([_STEPS, 1.0], last("skips/skipped_steps")[1:])
    self.assertEqual([_STEPS, 1.0], last("skips/nonfinite_steps_tower_1")[1:])
    self.assertEqual([_STEPS, 0.0], last("skips/nonfinite_steps_tower_0")[1:])
    explained = _get(port, "/data/plugin/text/text", run=".",
                     tag="skips/explained")
    self.assertLen(explained, 1)
    self.assertEqual(_POISONED_STEP, explained[0]["step"])
    self.assertIn("not reproducible", explained[0]["text"])

  def testASkipAtStep5OfTwentyIsAtPoint6AndTheLastStepsValuesAtPoint20(self):
    # Issue #37's done-when. Summaries are stamped with global_step after
    # the step (the loss of step 5 is at 6): "skipped step 5" is at 6.
    train_dir = os.path.join(self.get_temp_dir(), "twenty")
    params = params_lib.TrainParams(
        train_dir=train_dir, model="small_cnn", num_towers=2, device="cpu",
        batch_size=4, max_steps=_LONG_STEPS, save_checkpoints_steps=100000,
        log_every_n_steps=100, max_explained_skips=0,
        inject_nonfinite="nan@%d:1" % _LONG_POISONED_STEP).validate()
    self.assertEqual(100, params.save_summaries_steps)  # The default.
    summary = train_lib.train(params, dataset_fn=_shrunk_dataset)
    self.assertEqual(1, summary["skipped_steps"])
    port = self._start(train_dir)
    tags = ["skips/skipped_steps", "skips/skip_marker", "skips/applied_steps"]
    self.assertContainsSubset(tags, self._wait_for_tags(port, "scalars",
                                                        tags))

    at = _LONG_POISONED_STEP + 1
    skipped = _points(port, "skips/skipped_steps")
    self.assertEqual(1.0, skipped[at])
    self.assertEqual([], [s for s, v in skipped.items() if s < at and v])
    self.assertEqual(_LONG_STEPS, max(skipped))  # The last step's values.
    self.assertEqual(1.0, skipped[_LONG_STEPS])
    marker = _points(port, "skips/skip_marker")
    self.assertEqual(1.0, marker[at])
    self.assertEqual([at], [s for s, v in marker.items() if v])
    self.assertEqual(0.0, marker[_LONG_STEPS])
    applied = _points(port, "skips/applied_steps")
    self.assertEqual(_LONG_STEPS - 1.0, applied[_LONG_STEPS])


if __name__ == "__main__":
  tf.test.main()
