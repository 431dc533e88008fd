"""`//:replay` re-runs a recorded skip offline; skips.jsonl survives SIGKILL.

The quick start's input drill runs through `//:train` as a user would;
`//:replay` must print the run's report line for a recorded step, and fail
with one line for bad input. A trainer killed with SIGKILL right after it
recorded a skip and restarted must lose no record, and feed no recorded
example again.

A binary is launched once per claim about binaries (exit code, printed
line, error line); what the library behind it decides (another verdict,
another refusal, a restart after the kill) is checked in-process, each
launch costing TensorFlow's import. The killed trainer is forked from the
binaries server too (`binaries.run` in a thread, killed from the test).
"""

import json
import os
import shutil
import tempfile
import threading
import time

import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train import cli
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.explain import offline_replay
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.run import train_lib

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
  values = dict(dict(num_towers=2, device="cpu", batch_size=4,
                     save_summaries_steps=1000, log_every_n_steps=1000),
                **values)
  return train_lib.train(params_lib.TrainParams(
      train_dir=train_dir, **values).validate())


class ReplayBinaryTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    cls.root = root
    cls.input_dir = os.path.join(root, "input")
    # One tower (the flag given last wins): no claim here is about towers.
    cls.input_log = _train(cls.input_dir, "--max_steps=3", "--num_towers=1",
                           "--inject_nonfinite=nan@1:0",
                           "--inject_into=input").stderr
    cls.grads_dir = os.path.join(root, "grads")
    # One tower: its claims are not about towers.
    _train_in_process(cls.grads_dir, max_steps=3, num_towers=1,
                      inject_nonfinite="nan@2:0")

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
    # In-process: the binary prints this line (the case above). Its params
    # say --max_explained_skips=0 (as a quarantine's forced replay saves
    # them): //:replay builds the probes a run of them would not.
    train_dir = self._copy(self.grads_dir, "no_explained")
    (saved,) = skip_log.read(skip_log.path(train_dir))
    path = os.path.join(train_dir, saved["state_dir"], "params.json")
    with open(path) as f:
      values = json.load(f)
    values["params"]["max_explained_skips"] = 0
    with open(path, "w") as f:
      json.dump(values, f)
    record, _, line = offline_replay.replay_recorded(train_dir, 2)
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


def _parent(pid):
  """The parent pid of process `pid`, or None if it is gone."""
  try:
    with open("/proc/%d/stat" % pid) as f:
      return int(f.read().rsplit(")", 1)[1].split()[1])
  except (OSError, IndexError, ValueError):
    return None


def _runs_of(train_dir):
  """The processes of a `binaries.run` of `train_dir`: a run forked from
  the server (our child) is our grandchild; a fresh one has `train_dir` on
  its command line."""
  pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
  children = {p for p in pids if _parent(p) == os.getpid()}
  return sorted(set(p for p in pids if _parent(p) in children) |
                set(binaries.processes_with(train_dir)))


class SigkillTest(tf.test.TestCase):

  def testOneRecordPerSkipAcrossSigkillAndRestart(self):
    train_dir = os.path.join(self.get_temp_dir(), "killed")
    # One tower: the claim is of records and examples, not of towers.
    drill = dict(max_steps=6, save_checkpoints_steps=1, num_towers=1,
                 inject_nonfinite="nan@2:0,nan@4:0", inject_into="input")
    log = skip_log.path(train_dir)
    ended = []
    # //:train forked from the binaries server (no TensorFlow import of its
    # own), killed from here: a SIGKILL to its process as to a fresh one.
    flags = [f for f in _TRAIN_FLAGS if not f.startswith("--num_towers=")]
    flags += ["--%s=%s" % item for item in sorted(drill.items())]
    run = threading.Thread(target=lambda: ended.append(binaries.run(
        "train", "--train_dir=" + train_dir, *flags, timeout=300)))
    run.start()
    try:
      deadline = time.time() + 300
      # Until a whole record is there (the file exists a moment before).
      while not (os.path.exists(log) and skip_log.read(log)) and not ended:
        self.assertLess(time.time(), deadline)
        time.sleep(0.01)
      # Killed right after the first record: the step's checkpoint may or
      # may not be written; either way the restart must not lose or
      # duplicate a record.
      binaries.kill(_runs_of(train_dir))
    finally:
      run.join()
    self.assertNotEqual(ended[0].returncode, 0, ended[0].stderr)
    # (A slow poll may see the second record too.)
    before = skip_log.read(log)
    self.assertIn([r["step"] for r in before], ([2], [2, 4]))
    # The restart in-process: the claim is of the files the kill left.
    _train_in_process(train_dir, **drill)
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
