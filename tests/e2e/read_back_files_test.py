"""Files a run reads back, damaged: one line naming the file, exit 2.

One test per case of issue 23 (items 6 and 7). A finished run with one
explained skip (its `skips.jsonl` record and `skips/step-1-1/` state) is
copied for each case, and one file of the copy is damaged as an operator or
an unlucky disk would. Each case is read back as `//:train`, `//:replay` or
`//:eval` read it: the library call the binary makes (`train_lib.train`,
`offline_replay.replay_recorded`) refuses with the error class the binary
turns into one line and exit 2, its message one line naming the file and
the problem. `BinaryTest` runs the binaries themselves on a case of each
kind (a record, a file that is not one, a saved state, eval's input): exactly
one error line, last, exit code 2, no traceback.
"""

import json
import os
import shutil
import tempfile

from absl import logging
import numpy as np
import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train import cli
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.inputs import checkpoint_rollback_window
from tf1_safe_train.trainer.explain import offline_replay
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_FLAGS = ["--num_towers=2", "--device=cpu", "--batch_size=2",
          "--save_summaries_steps=1000", "--log_every_n_steps=1000"]


def _params(train_dir, max_steps):
  """The params `//:train` makes of `_FLAGS` and these two flags."""
  return params_lib.TrainParams(
      train_dir=train_dir, num_towers=2, device="cpu", batch_size=2,
      max_steps=max_steps, save_summaries_steps=1000,
      log_every_n_steps=1000).validate()


_FINISHED_RUN = []


def _finished_run():
  """(a root directory, the finished run in it), trained once per file."""
  if not _FINISHED_RUN:
    root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    run_dir = os.path.join(root, "run")
    train_lib.train(params_lib.TrainParams(
        train_dir=run_dir, num_towers=2, device="cpu", batch_size=2,
        max_steps=2, save_summaries_steps=1000, log_every_n_steps=1000,
        inject_nonfinite="nan@1:0", inject_into="input").validate())
    _FINISHED_RUN.extend([root, run_dir])
  return tuple(_FINISHED_RUN)


class _Case(tf.test.TestCase):
  """A copy of the finished run per test, and the one-line contract."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root, cls.run_dir = _finished_run()

  def setUp(self):
    super().setUp()
    self.train_dir = os.path.join(tempfile.mkdtemp(dir=self.root), "run")
    shutil.copytree(self.run_dir, self.train_dir, symlinks=True)
    self.log = skip_log.path(self.train_dir)
    (self.record,) = skip_log.read(self.log)
    self.state = os.path.join(self.train_dir, self.record["state_dir"])

  def assertOneLine(self, program, result, *expected):
    self.assertEqual(result.returncode, cli.EXIT_BAD_INPUT, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertStartsWith(errors[0], program + ": error: ")
    self.assertEqual(binaries.our_lines(result.stderr)[-1], errors[0])
    for text in expected:
      self.assertIn(text, errors[0])

  def assertRefusal(self, error, *expected):
    """`error`, raised where the binary would print it, is one line."""
    self.assertNotIn("\n", str(error))
    for text in expected:
      self.assertIn(text, str(error))

  def assertTrainRefuses(self, *expected):
    # train.py turns a TrainDirError into "train: error: <it>", exit 2
    # (BinaryTest); the run's files are read before a graph is built.
    with self.assertRaises(train_lib.TrainDirError) as raised:
      train_lib.train(_params(self.train_dir, max_steps=3))
    self.assertRefusal(raised.exception, *expected)

  def assertReplayRefuses(self, *expected):
    # replay.py turns a ReplayError into "replay: error: <it>", exit 2.
    with self.assertRaises(offline_replay.ReplayError) as raised:
      offline_replay.replay_recorded(self.train_dir, 1)
    self.assertRefusal(raised.exception, *expected)

  def assertTrainBinaryRefuses(self, *expected):
    result = binaries.run("train", "--train_dir=" + self.train_dir,
                          "--max_steps=3", *_FLAGS, timeout=600)
    self.assertOneLine("train", result, *expected)

  def assertReplayBinaryRefuses(self, *expected):
    result = binaries.run("replay", "--train_dir=" + self.train_dir,
                          "--step=1", timeout=600)
    self.assertOneLine("replay", result, *expected)

  def writeRecord(self, **fields):
    """Appends a copy of the run's record with `fields` changed (raw JSON:
    what a hand edit or another tool could write)."""
    record = dict(self.record, **fields)
    with open(self.log, "a") as f:
      f.write(json.dumps(record) + "\n")

  def replaceWith(self, path, kind):
    """Puts a directory, or a symlink to nowhere, where `path` was."""
    if os.path.exists(path):
      os.remove(path)
    if kind == "directory":
      os.makedirs(path)
    else:
      os.symlink(os.path.join(self.root, "nowhere", "x"), path)

  def truncateBatch(self):
    path = os.path.join(self.state, "batch.npz")
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


class BinaryTest(_Case):
  """The binaries on a case of each kind: one line, last, exit 2."""

  def testTrainOnABadRecord(self):
    self.writeRecord(step=[5])
    self.assertTrainBinaryRefuses("skips.jsonl line 2", "step is [5]")

  def testTrainOnALockThatIsADirectory(self):
    self.replaceWith(os.path.join(self.train_dir, "train.lock"), "directory")
    self.assertTrainBinaryRefuses("train.lock is a directory")

  def testReplayOnATruncatedBatch(self):
    self.truncateBatch()
    self.assertReplayBinaryRefuses("batch.npz: damaged")

  def testEvalBatchLargerThanTheTestSplit(self):
    result = binaries.run("eval", "--train_dir=" + self.train_dir,
                          "--batch_size=5000", timeout=600)
    self.assertOneLine("eval", result, "--batch_size=5000",
                       "2000 examples of the synthetic test split")


class SkipLogRecordsTest(_Case):
  """skips.jsonl records read back at start-up (and by //:replay)."""

  def testListStep(self):
    self.writeRecord(step=[5])
    self.assertTrainRefuses("skips.jsonl line 2", "step is [5]")

  def testStringStep(self):
    self.writeRecord(step="5")
    self.assertTrainRefuses("skips.jsonl line 2", 'step is "5"')

  def _bad_id(self, value, expected):
    towers = [dict(t, example_ids=[value]) for t in self.record["towers"]]
    self.writeRecord(towers=towers, reproduced=True, replay=dict(
        self.record["replay"], input_ids=[]))
    self.assertTrainRefuses("skips.jsonl line 2", expected)

  def testStringId(self):
    self._bad_id("abc", '"abc" is not an integer')

  def testNullId(self):
    self._bad_id(None, "null is not an integer")

  def testIdBeyondInt64(self):
    self._bad_id(2**70, "does not fit int64")

  def testFloatId(self):
    self._bad_id(1e300, "is not an integer")

  def testReplayNotAnObject(self):
    with open(self.log, "w") as f:  # The explained record, edited.
      f.write(json.dumps(dict(self.record, replay="x")) + "\n")
    self.assertTrainRefuses("skips.jsonl line 1", 'replay is "x"')
    self.assertReplayBinaryRefuses("skips.jsonl line 1", 'replay is "x"')


class NotAFileTest(_Case):
  """A log or the lock that is a directory or a dangling symlink."""

  def testSkipLogIsADirectory(self):
    self.replaceWith(self.log, "directory")
    self.assertTrainRefuses("skips.jsonl is a directory")

  def testSkipLogIsADanglingSymlink(self):
    self.replaceWith(self.log, "symlink")
    self.assertTrainRefuses("skips.jsonl is a dangling symlink")

  def testRollbackWindowsIsADirectory(self):
    self.replaceWith(checkpoint_rollback_window.path(self.train_dir),
                     "directory")
    self.assertTrainRefuses("rollback_windows.jsonl is a directory")

  def testRollbackWindowsIsADanglingSymlink(self):
    self.replaceWith(checkpoint_rollback_window.path(self.train_dir), "symlink")
    self.assertTrainRefuses("rollback_windows.jsonl is a dangling symlink")

  def testLockIsADirectory(self):
    self.replaceWith(os.path.join(self.train_dir, "train.lock"), "directory")
    self.assertTrainRefuses("train.lock is a directory")

  def testLockIsADanglingSymlink(self):
    self.replaceWith(os.path.join(self.train_dir, "train.lock"), "symlink")
    self.assertTrainRefuses("train.lock is a dangling symlink")


class RollbackWindowRecordsTest(_Case):

  def testHugeFloatId(self):
    skip_log.append(checkpoint_rollback_window.path(self.train_dir), {
        "step": 3, "worker": 0, "time": 0.0, "reason": "rollback_window",
        "towers": [], "data_window": [1, 2], "example_ids": [1e23],
        "steps_without_ids": 0})
    self.assertTrainRefuses("rollback_windows.jsonl line 1",
                            "1e+23 is not an integer")


class SavedStateTest(_Case):
  """A skip's saved state, read back by //:replay."""

  def testTruncatedBatch(self):
    self.truncateBatch()
    self.assertReplayRefuses("batch.npz: damaged")

  def testGarbageParams(self):
    with open(os.path.join(self.state, "params.json"), "w") as f:
      f.write("{garbage")
    self.assertReplayRefuses("params.json: not readable as JSON")

  def testNumTowersEdited(self):
    path = os.path.join(self.state, "params.json")
    with open(path) as f:
      saved = json.load(f)
    saved["params"]["num_towers"] = 3
    with open(path, "w") as f:
      json.dump(saved, f)
    self.assertReplayRefuses("batch.npz holds 2 tower(s)' batches",
                             "num_towers=3")


class ExtremeExclusionTest(_Case):
  """(issue 23, 6) What the skip logs exclude leaves too little data."""

  def _exclude(self, ids):
    self.writeRecord(step=2, reproduced=True, replay=dict(
        self.record["replay"], input_ids=[int(i) for i in ids]))

  def testEveryExampleExcluded(self):
    self._exclude(np.arange(10000))
    self.assertTrainRefuses("leaves 0 of the data's 10000",
                            "fewer than a batch (--batch_size=2)")

  def testAllButOneExcluded(self):
    self._exclude(np.arange(1, 10000))
    self.assertTrainRefuses("leaves 1 of the data's 10000")

  def testUnknownIdsAreReportedNotExcluded(self):
    self._exclude([-1, 10000, 123456789])
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      summary = train_lib.train(_params(self.train_dir, max_steps=3))
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertIn("3 unknown example ids ignored (not in the data, e.g. -1, "
                  "10000, 123456789)", "\n".join(logs.output))
    with open(os.path.join(self.train_dir, "run_summary.json")) as f:
      excluded = json.load(f)["forensics"]["excluded_examples"]
    self.assertEqual(excluded["unknown"], 3)
    # Only the first record's (the run's own skip) known ids.
    self.assertEqual(excluded["count"],
                     len(self.record["replay"]["input_ids"]))


if __name__ == "__main__":
  tf.test.main()
