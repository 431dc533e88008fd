"""What a run says of a skip, end to end: its log's order, TensorBoard.

One 20-step in-process run on two virtual CPU towers whose step 5 is
poisoned (`--inject_nonfinite=nan@5:1`) and explained (replayed): the skip's
line comes before its explanation, the progress line naming step 5 counts
its skip, and TensorBoard's skip counters show the skip at the step, not at
the next sampled one (every --save_summaries_steps), and the last step's
values (issue 37, points 2 and 6).
"""

import glob
import os
import tempfile

import tensorflow as tf

from tests.fixtures import run_logs
from tests.fixtures import forensics_params
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_STEPS = 20
_SKIPPED = 5


def _points(train_dir, tag):
  """{step: value} of `tag` in the run's event files."""
  points = {}
  for path in glob.glob(os.path.join(train_dir, "events.*")):
    for event in tf1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          points.setdefault(event.step, []).append(value.simple_value)
  return points


class RunReportTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.train_dir = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    with run_logs.capture(level="INFO") as logs:
      cls.summary = train_lib.train(forensics_params.params(
          cls.train_dir, max_steps=_STEPS, log_every_n_steps=5,
          # TensorFlow's default: summaries sampled every 100 steps.
          save_summaries_steps=100, max_explained_skips=1,
          inject_nonfinite="nan@%d:1" % _SKIPPED, inject_into="grads"))
    cls.messages = [r.getMessage() for r in logs.records]

  def _index(self, prefix):
    found = [i for i, m in enumerate(self.messages) if m.startswith(prefix)]
    self.assertLen(found, 1, "%r in %s" % (prefix, self.messages))
    return found[0]

  def testTheSkipLineComesBeforeItsExplanation(self):
    self.assertEqual(self.summary["skipped_steps"], 1)
    line = self._index("skipped step %d: non-finite gradients in tower 1"
                       % _SKIPPED)
    explanation = self._index("step %d tower 1: " % _SKIPPED)
    self.assertLess(line, explanation)

  def testTheProgressLineOfTheSkippedStepCountsItsSkip(self):
    progress = [m for m in self.messages if m.startswith("step ") and
                "examples/s" in m]
    (at_skip,) = [m for m in progress
                  if m.startswith("step %d/%d " % (_SKIPPED, _STEPS))]
    self.assertIn("applied %d  skipped 1" % _SKIPPED, at_skip)
    # And after the skip's line, never before it.
    self.assertLess(self._index("skipped step %d" % _SKIPPED),
                    self.messages.index(at_skip))
    # The run's last step has its line too.
    self.assertTrue(progress[-1].startswith("step %d/%d " % (
        _STEPS - 1, _STEPS)), progress[-1])
    self.assertIn("applied %d  skipped 1" % (_STEPS - 1), progress[-1])

  def testTensorBoardCountersShowTheSkipAtItsStepAndTheLastStep(self):
    # Stamped with global_step after the step, as every summary of the run
    # (the loss of a step and its skip share a point): step 5's skip at 6.
    skipped = _points(self.train_dir, "skips/skipped_steps")
    self.assertEqual(skipped[_SKIPPED + 1], [1.0])
    self.assertEqual(skipped[_STEPS], [1.0])
    self.assertEqual(skipped[1], [0.0])  # The first step.
    self.assertEqual(_points(self.train_dir, "skips/nonfinite_steps_tower_1")
                     [_SKIPPED + 1], [1.0])
    self.assertEqual(_points(self.train_dir, "skips/consecutive_skips")
                     [_SKIPPED + 2], [0.0])
    # The marker: 1 at the skipped step only.
    marker = _points(self.train_dir, "skips/skip_marker")
    self.assertEqual({s for s, v in marker.items() if v == [1.0]},
                     {_SKIPPED + 1})
    self.assertEqual(marker[_STEPS], [0.0])
    self.assertEqual(_points(self.train_dir, "skips/applied_steps")[_STEPS],
                     [_STEPS - 1.0])


if __name__ == "__main__":
  tf.test.main()
