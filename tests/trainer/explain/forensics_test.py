"""Every skip explained: skips.jsonl records, replay verdicts, exclusion.

The trainer runs in-process on virtual CPU towers under the quick start's
drills; each skip must leave one record with its verdict (input drill: data,
named with its examples; loss/grads drills: the device), replays are
rate-limited, a record is appended before any checkpoint covering its step,
and a restart never reads the examples of a reproducible skip again.
Each run builds a graph (seconds): the runs are shared, in `setUpClass`.
"""

import json
import os
import tempfile
from unittest import mock

import tensorflow as tf

from tests.fixtures import run_logs
from tests.fixtures import forensics_params
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.checkpoint import checkpoints
from tf1_safe_train.trainer.explain import forensics
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.run import train_lib

_params = forensics_params.params
tf1 = tf.compat.v1


class ForensicsTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Its own folder: the process's temporary folder is shared by the test
    # files of a shard (another class may train in "fp16" there too).
    root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    # The input drill's train_dir sees three runs: the drill (step 0: the
    # restarts read the same stream from its start again), a restart that
    # excludes its examples, and a control restart that does not exclude
    # them. The control also runs the grads drill: its skip at step 4 on
    # tower 1 (the one replay --max_explained_skips=1 allows) and at step 5
    # on tower 0 (recorded, not replayed: the rate limit), a checkpoint
    # every step (each record is appended before one covers its step).
    train_dir = cls.input_dir = os.path.join(root, "input")
    cls.first = train_lib.train(_params(train_dir, max_steps=2,
                                        inject_nonfinite="nan@0:0",
                                        inject_into="input"))
    cls.input_records = skip_log.read_all(train_dir)
    cls.stored = forensics_params.FedIds()
    with run_logs.capture(level="INFO") as logs:
      cls.second = train_lib.train(_params(train_dir, max_steps=4),
                                   extra_hooks=[cls.stored])
    cls.second_logs = logs.output
    cls.saved = []  # (step, the steps recorded then) of each checkpoint.
    save = checkpoints.FiniteSaver.save

    def recording_save(saver, sess, save_path, global_step=None, **kwargs):
      step = int(sess.run(global_step) if tf.is_tensor(global_step)
                 else global_step)
      cls.saved.append((step, [r["step"] for r in skip_log.read_all(
          train_dir)]))
      return save(saver, sess, save_path, global_step=global_step, **kwargs)

    cls.control = forensics_params.FedIds()
    with mock.patch.object(checkpoints.FiniteSaver, "save", recording_save):
      cls.grads = train_lib.train(_params(
          train_dir, max_steps=6, exclude_reproducible_skips=False,
          max_explained_skips=1, save_checkpoints_steps=1,
          inject_nonfinite="nan@4:1,nan@5:0", inject_into="grads"),
                                  extra_hooks=[cls.control])
    # One fp16 run on one tower proves the loss drill's verdict (its skip at
    # the floor scale, the only one replayed) and the fp16 replay policy.
    cls.fp16_dir = os.path.join(root, "fp16")
    train_lib.train(_params(cls.fp16_dir, num_towers=1, precision="fp16",
                            initial_loss_scale=4.0, inject_nonfinite="inf@1-3",
                            inject_into="loss"))

  def testInputDrillIsDataNamedWithItsExamplesAndNeverReadAgain(self):
    first, records = self.first, self.input_records
    self.assertEqual([r["step"] for r in records], [0])
    record = records[0]
    self.assertEqual(record["verdict"], replay_lib.REPRODUCIBLE)
    self.assertTrue(record["reproduced"])
    self.assertIsNone(record["suspect_device"])
    tower0 = record["towers"][0]
    self.assertTrue(tower0["nonfinite"])
    self.assertLen(tower0["example_ids"], 4)
    replay = record["replay"]
    self.assertFalse(replay["finite"])
    self.assertEqual(replay["phase"], "forward")
    self.assertIn("small_cnn", replay["first_op"])
    self.assertEqual(replay["input_rows"], {"images": [0, 1, 2, 3]})
    self.assertEqual(replay["input_ids"], tower0["example_ids"])
    self.assertEqual(replay["input_examples"],
                     ["train#%d" % i for i in tower0["example_ids"]])
    self.assertIn("input holds NaN/Inf", replay["text"])
    self.assertFalse(record["other"]["finite"])  # Tower 1 reproduces it.
    self.assertEqual(first["forensics"]["verdicts"], {"reproducible": 1})
    bad = set(tower0["example_ids"])

    # Said once at startup, not only in run_summary.json.
    self.assertLen([m for m in self.second_logs if "not feeding 4 examples "
                    "again (4 nonfinite input; --noexclude_reproducible_skips "
                    "feeds them)" in m], 1)
    excluded = self.second["forensics"]["excluded_examples"]
    self.assertEqual(excluded["count"], 4)
    self.assertEqual(excluded["by_reason"], {"nonfinite_input": 4})
    self.assertNotEmpty(self.stored.ids)
    self.assertEmpty(self.stored.ids & bad)

    # Off: the same restart reads them again (what the test above guards).
    self.assertEqual(
        self.grads["forensics"]["excluded_examples"]["count"], 0)
    self.assertTrue(bad <= self.control.ids)

  def testGradsDrillIsNotReproducibleAndNamesTheDevice(self):
    train_dir, summary = self.input_dir, self.grads
    record = skip_log.read_all(train_dir)[1]  # After the input drill's.
    self.assertEqual(record["step"], 4)
    self.assertEqual(record["verdict"],
                     "not reproducible: suspect /device:CPU:1")
    self.assertEqual(record["suspect_device"], "/device:CPU:1")
    self.assertEqual(record["replay"]["tower"], 1)
    self.assertTrue(record["replay"]["finite"])
    self.assertEqual([t["nonfinite"] for t in record["towers"]],
                     [False, True])
    self.assertNotEmpty(record["towers"][1]["variables"])
    self.assertEqual(summary["forensics"]["suspect_devices"],
                     {"/device:CPU:1": 1})
    self.assertEqual(summary["forensics"]["explained_skips"], 1)
    # K = 2: state serials run on across the train_dir's runs (the input
    # drill's was step-0-1).
    self.assertEqual(record["state_dir"], os.path.join("skips", "step-4-2"))
    saved = os.path.join(train_dir, record["state_dir"])
    with open(os.path.join(saved, forensics.PARAMS_FILE)) as f:
      self.assertEqual(json.load(f)["step"], 4)

  def testLossDrillOnOneTowerIsNotReproducibleOnTheSameDevice(self):
    # The fp16 run's skip at the floor scale (testFp16Replays...).
    record = skip_log.read_all(self.fp16_dir)[2]
    self.assertEqual(record["verdict"],
                     "not reproducible: suspect /device:CPU:0")
    self.assertTrue(record["weaker"])
    self.assertNotIn("other", record)  # No other tower to replay on.

  def testReplaysAreRateLimitedButEverySkipIsRecordedBeforeACheckpoint(self):
    train_dir, summary = self.input_dir, self.grads
    records = skip_log.read_all(train_dir)[1:]  # The grads drill's.
    self.assertEqual([r["step"] for r in records], [4, 5])
    self.assertIn("replay", records[0])
    self.assertEqual(records[1]["verdict"], forensics.NOT_EXPLAINED)
    self.assertNotIn("replay", records[1])
    self.assertEqual(records[1]["towers"][0]["nonfinite"], True)
    # (The input drill's state, older, pruned: one kept across runs.)
    self.assertEqual(os.listdir(os.path.join(train_dir, forensics.SKIPS_DIR)),
                     ["step-4-2"])
    self.assertEqual(summary["forensics"]["skip_records"], 2)
    self.assertEqual(summary["forensics"]["explained_skips"], 1)
    # A checkpoint of step S covers the skips of steps below S: their
    # records (replayed or not) were already there when it was written.
    self.assertEqual([step for step, _ in self.saved if step > 4], [5, 6])
    for step, recorded in self.saved:
      self.assertEqual(recorded, [s for s in (0, 4, 5) if s < step], step)

  def testFp16ReplaysOnlySkipsAtTheFloorScaleWithTheScaleTheStepUsed(self):
    # Scale 4 -> 2 -> 1: the first two skips are expected overflows.
    records = skip_log.read_all(self.fp16_dir)
    self.assertEqual([r["step"] for r in records], [1, 2, 3])
    self.assertEqual([r["loss_scale"] for r in records], [4.0, 2.0, 1.0])
    for record, scale in zip(records[:2], ("4", "2")):
      self.assertEqual(record["verdict"], forensics.OVERFLOW % scale)
      self.assertNotIn("replay", record)
    self.assertEqual(records[2]["verdict"],
                     "not reproducible: suspect /device:CPU:0")


if __name__ == "__main__":
  tf.test.main()
