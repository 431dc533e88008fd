"""A wrecked model is the model, not the data, and is never called good.

`--optimizer=sgd --learning_rate=1e38`: step 0 has finite gradients, is
applied and leaves finite weights near 1e38 on which every batch is
non-finite. Through the binaries, as a user runs them: the replays find
that every batch fails on these weights, so the run stops at once (exit 1,
one line naming the checkpoint written before the last applied step) and
excludes nothing but the examples whose input held NaN (an input drill at
step 1); a restart (in process, on a copy) excludes exactly those;
`//:eval` refuses the wrecked weights; and without replays, pruning during
the skip streak keeps the checkpoint before it, which the give-up line
names (docs/forensics.md, docs/checkpoints.md).
"""

import json
import os
import shutil
import tempfile

import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_FLAGS = ["--num_towers=2", "--device=cpu", "--model=small_cnn",
          "--batch_size=8", "--optimizer=sgd", "--max_steps=30",
          "--save_checkpoints_steps=2", "--save_summaries_steps=1000",
          "--log_every_n_steps=1000"]
_WRECK = "--learning_rate=1e38"


def _summary(train_dir):
  with open(os.path.join(train_dir, "run_summary.json")) as f:
    return json.load(f)


class WreckedModelTest(tf.test.TestCase, binaries.OneLineErrorAssertions):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    cls.train_dir = os.path.join(cls.root, "wrecked")
    cls.first = binaries.run(
        "train", "--train_dir=" + cls.train_dir, _WRECK,
        "--inject_nonfinite=nan@1:1", "--inject_into=input", *_FLAGS)
    cls.first_summary = _summary(cls.train_dir)
    cls.records = skip_log.read_all(cls.train_dir)

  def testEveryBatchFailingIsTheModelAndStopsTheRun(self):
    self.assertOneLineError(
        self.first, "stopped at step 3: " + replay_lib.MODEL,
        "nothing excluded", "model.ckpt-0 in " + self.train_dir,
        exit_code=1)
    summary = self.first_summary
    self.assertEqual(summary["exit_reason"], "model_fault")
    self.assertEqual(summary["model_fault_step"], 2)
    self.assertEqual((summary["applied_steps"], summary["skipped_steps"]),
                     (1, 2))
    self.assertEqual([r["step"] for r in self.records], [1, 2])
    nan_input, model = self.records
    # Step 1: tower 1's input held NaN: the data, whatever the weights.
    self.assertEqual(nan_input["replay"]["tower"], 1)
    self.assertEqual(nan_input["verdict"], replay_lib.REPRODUCIBLE)
    self.assertTrue(nan_input["exclude"])
    self.assertLen(nan_input["replay"]["input_ids"], 8)
    # Step 2: the last applied batch (step 0's) fails on these weights too.
    self.assertEqual(model["verdict"], replay_lib.MODEL)
    self.assertFalse(model["exclude"])
    self.assertEqual(model["control"]["source"], "last_applied_batch")
    self.assertEqual(model["control"]["step"], 0)
    self.assertFalse(model["control"]["finite"])
    self.assertTrue(os.path.exists(
        os.path.join(self.train_dir, "model.ckpt-0.index")))

  def testRestartExcludesExactlyTheNonFiniteInput(self):
    # In process, on a copy: the stop's one error line is the first run's.
    train_dir = os.path.join(self.root, "restarted")
    shutil.copytree(self.train_dir, train_dir, symlinks=True)
    params = params_lib.TrainParams(
        train_dir=train_dir, num_towers=2, device="cpu", model="small_cnn",
        batch_size=8, optimizer="sgd", learning_rate=0.01, max_steps=30,
        save_checkpoints_steps=2, save_summaries_steps=1000,
        log_every_n_steps=1000).validate()
    with self.assertLogs(level="INFO") as logs:
      summary = train_lib.train(params)
    # The weights are still wrecked: the restart stops the same way.
    self.assertEqual(summary["exit_reason"], "model_fault")
    self.assertIn("not feeding 8 examples again (8 nonfinite input",
                  "\n".join(logs.output))
    excluded = _summary(train_dir)["forensics"]["excluded_examples"]
    self.assertEqual(excluded["count"], 8)
    self.assertEqual(excluded["by_reason"], {"nonfinite_input": 8})
    self.assertEqual(excluded["steps"], [{"step": 1, "worker": 0}])
    records = skip_log.read_all(train_dir)
    self.assertEqual([r["verdict"] for r in records[2:]], [replay_lib.MODEL])
    self.assertEqual(records[2]["evidence"],
                     "every tower's batch of the step failed")

  def testEvalRefusesANonFiniteLoss(self):
    result = binaries.run("eval", "--train_dir=" + self.train_dir,
                          "--max_examples=200")
    self.assertEqual(result.returncode, 1, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertStartsWith(errors[0], "eval: error: ")
    self.assertIn("the loss is NaN or Inf on 200 of 200 test examples",
                  errors[0])

  def testPruningKeepsTheCheckpointBeforeTheStreak(self):
    train_dir = os.path.join(self.root, "pruned")
    # No replays: no verdict, the streak runs to --max_consecutive_skips
    # while checkpoints are written (and pruned) every 2 steps. One tower:
    # the claim is not about towers.
    flags = ["--num_towers=1" if f.startswith("--num_towers=") else f
             for f in _FLAGS]
    result = binaries.run("train", "--train_dir=" + train_dir, _WRECK,
                          "--max_explained_skips=0",
                          "--max_consecutive_skips=12", *flags)
    self.assertOneLineError(
        result, "gave up after 12 consecutive skipped steps at step 13",
        "the streak began at step 1: model.ckpt-0 in " + train_dir,
        exit_code=1)
    present = sorted(int(n[len("model.ckpt-"):-len(".index")])
                     for n in os.listdir(train_dir) if n.endswith(".index"))
    self.assertEqual(present, [0, 6, 8, 10, 12, 13])
    state = tf1.train.get_checkpoint_state(train_dir)
    self.assertIn("model.ckpt-0", [os.path.basename(p) for p in
                                   state.all_model_checkpoint_paths])


if __name__ == "__main__":
  tf.test.main()
