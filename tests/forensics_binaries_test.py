"""`//:replay` re-runs a recorded skip offline; skips.jsonl survives SIGKILL.

The quick start's input drill runs through `//:train` as a user would;
`//:replay` must print the run's report line for a recorded step, and fail
with one line for bad input. A trainer killed with SIGKILL right after it
recorded a skip and restarted must lose no record, and feed no recorded
example again.

A binary is launched once per claim about binaries (exit code, printed
line, error line); what the library behind it decides (another verdict,
another refusal, a restart after the kill) is checked in-process, each
launch costing TensorFlow's import.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time

import tensorflow as tf

import binaries
from tf1_safe_train import cli
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer import offline_replay
from tf1_safe_train.trainer import params as params_lib
from tf1_safe_train.trainer import replay_lib
from tf1_safe_train.trainer import train_lib

tf1 = tf.compat.v1

_TRAIN_FLAGS = ["--num_towers=2", "--device=cpu", "--batch_size=4",
                "--save_summaries_steps=1000", "--log_every_n_steps=1000"]


def _train(train_dir, *flags):
  result = binaries.run("train", "--train_dir=" + train_dir, *(
      _TRAIN_FLAGS + list(flags)), timeout=600)
  assert result.returncode == 0, result.stderr
  return result


def _train_in_process(train_dir, **values):
  """`_train` as a library call: `TrainParams` of `_TRAIN_FLAGS` and
  `values`."""
  return train_lib.train(params_lib.TrainParams(
      train_dir=train_dir, num_towers=2, device="cpu", batch_size=4,
      save_summaries_steps=1000, log_every_n_steps=1000,
      **values).validate())


class ReplayBinaryTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    cls.root = root
    cls.input_dir = os.path.join(root, "input")
    cls.input_log = _train(cls.input_dir, "--max_steps=3",
                           "--inject_nonfinite=nan@1:1",
                           "--inject_into=input").stderr
    cls.grads_dir = os.path.join(root, "grads")
    _train_in_process(cls.grads_dir, max_steps=3, inject_nonfinite="nan@2:0")

  def _replay(self, *flags):
    return binaries.run("replay", *flags, timeout=300)

  def assertReplaysAsRecorded(self, train_dir, step, verdict):
    result = self._replay("--train_dir=" + train_dir, "--step=%d" % step)
    self.assertEqual(result.returncode, 0, result.stderr)
    (record,) = [r for r in skip_log.read_all(train_dir)
                 if r["step"] == step]
    self.assertEqual(record["verdict"], verdict)
    lines = binaries.our_lines(result.stdout)
    self.assertTrue(lines[0].startswith("step %d tower " % step), lines)
    self.assertEqual(lines[0], replay_lib.line(step, record))
    return lines[0]

  def testReplaysAnInputSkipOfflineAsTheRunReportedIt(self):
    line = self.assertReplaysAsRecorded(self.input_dir, 1,
                                        replay_lib.REPRODUCIBLE)
    self.assertIn("input holds NaN/Inf", line)
    self.assertIn(line, self.input_log)  # The run logged the same line.

  def testReplaysAGradsSkipOfflineAsNotReproducible(self):
    # In-process: the binary prints this line (the case above).
    record, _, line = offline_replay.replay_recorded(self.grads_dir, 2)
    self.assertEqual(record["verdict"],
                     "not reproducible: suspect /device:CPU:0")
    self.assertTrue(line.startswith("step 2 tower "), line)
    self.assertEqual(line, replay_lib.line(2, record))

  def assertOneLineError(self, result, *expected):
    self.assertEqual(result.returncode, cli.EXIT_BAD_INPUT, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertTrue(errors[0].startswith("replay: error: "), errors[0])
    for text in expected:
      self.assertIn(text, errors[0])

  def testBadInputIsOneLine(self):
    self.assertOneLineError(self._replay("--train_dir=" + self.input_dir,
                                         "--step=2"),
                            "no skip of step 2", "recorded: 1")
    # Refused by the library call the binary makes, as the case above
    # (replay.py prints a ReplayError as that one line, exit 2).
    broken = self._copy(self.grads_dir, "broken")
    (record,) = skip_log.read(skip_log.path(broken))
    os.remove(os.path.join(broken, record["state_dir"], "batch.npz"))
    for train_dir, step, expected in (
        (os.path.join(self.root, "nowhere"), 1, "no such directory"),
        (self.root, 1, "no such file"),
        (broken, 2, "missing batch.npz")):
      with self.assertRaisesRegex(offline_replay.ReplayError, expected) as e:
        offline_replay.replay_recorded(train_dir, step)
      self.assertNotIn("\n", str(e.exception))
    self.assertOneLineError(self._replay("--step=1"), "--train_dir")
    self.assertOneLineError(self._replay("--train_dir=" + self.input_dir,
                                         "--step=x"), "step")

  def _copy(self, train_dir, name):
    """A copy of a finished run of setUpClass, for a test to damage."""
    copy = os.path.join(self.root, name)
    shutil.copytree(train_dir, copy, symlinks=True)
    return copy

  def testTrainingOnACorruptSkipLogIsOneLine(self):
    corrupt = self._copy(self.grads_dir, "corrupt")
    log = skip_log.path(corrupt)
    with open(log) as f:
      kept = f.read()
    with open(log, "w") as f:
      f.write("not json\n" + kept)
    result = binaries.run("train", "--train_dir=" + corrupt, "--max_steps=4",
                          *_TRAIN_FLAGS, timeout=300)
    self.assertEqual(result.returncode, cli.EXIT_BAD_INPUT, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertIn("skips.jsonl line 1", errors[0])
    self.assertIn("--noexclude_reproducible_skips", errors[0])


class SigkillTest(tf.test.TestCase):

  def testOneRecordPerSkipAcrossSigkillAndRestart(self):
    train_dir = os.path.join(self.get_temp_dir(), "killed")
    args = ["--train_dir=" + train_dir, "--max_steps=6",
            "--save_checkpoints_steps=1", "--inject_nonfinite=nan@2:0,nan@4:1",
            "--inject_into=input"] + _TRAIN_FLAGS
    log = skip_log.path(train_dir)
    process = subprocess.Popen(
        binaries.command("train") + args, env=binaries.env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
      deadline = time.time() + 300
      while not os.path.exists(log) and process.poll() is None:
        self.assertLess(time.time(), deadline)
        time.sleep(0.01)
      # Killed right after the first record: the step's checkpoint may or
      # may not be written; either way the restart must not lose or
      # duplicate a record.
      os.killpg(process.pid, signal.SIGKILL)
    finally:
      process.wait()
    # (A slow poll may see the second record too.)
    before = skip_log.read(log)
    self.assertIn([r["step"] for r in before], ([2], [2, 4]))
    # The restart in-process: the claim is of the files the kill left.
    _train_in_process(train_dir, max_steps=6, save_checkpoints_steps=1,
                      inject_nonfinite="nan@2:0,nan@4:1", inject_into="input")
    records = skip_log.read(log)
    # Nothing lost: the records written before the kill are still there.
    for record in before:
      self.assertIn(record, records)
    # A step the restart re-ran (its checkpoint was not written yet) skipped
    # again on other data: an event of its own, with its own record.
    self.assertEqual(sorted(set(r["step"] for r in records)), [2, 4])
    self.assertLessEqual(len(records), 4)
    self.assertEqual([r["verdict"] for r in records],
                     [replay_lib.REPRODUCIBLE] * len(records))
    ids = [i for r in records for i in r["replay"]["input_ids"]]
    self.assertEqual(len(ids), len(set(ids)))  # None fed twice.


if __name__ == "__main__":
  tf.test.main()
