"""Exclusion only on evidence of data (docs/forensics.md, "Data or model").

A batch whose replay fails is the data only when its input holds NaN/Inf,
or when another batch passes on the same weights: another tower's batch of
the step, else the last applied batch (kept by the batch store). The
trainer runs in-process with a finite input spike (`scale1e37`, input
drill): the batch overflows on a healthy model, so it is the data; with
one tower and nothing applied yet, nothing says so, and nothing is
excluded. A model verdict rolls back at once with
--on_persistent_skips=rollback.
"""

import os

import tensorflow as tf

from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.inputs import exclusion
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.run import train_lib


def _train(train_dir, **overrides):
  values = dict(train_dir=train_dir, device="cpu", batch_size=4,
                max_steps=3, inject_into="input",
                save_checkpoints_steps=1000, save_summaries_steps=1000,
                log_every_n_steps=1000)
  values.update(overrides)
  return train_lib.train(params_lib.TrainParams(**values).validate())


class ReplayEvidenceTest(tf.test.TestCase):

  def _record(self, name, **overrides):
    train_dir = os.path.join(self.get_temp_dir(), name)
    summary = _train(train_dir, **overrides)
    (record,) = skip_log.read_all(train_dir)
    self.assertTrue(record["reproduced"])
    self.assertEqual(record["replay"]["input_ids"], [])  # A finite input.
    return train_dir, summary, record

  def testBatchThatFailsWhereAnotherTowersPassesIsTheData(self):
    # Step 1's skip is the claim: no step after it (max_steps=2).
    train_dir, summary, record = self._record(
        "towers", num_towers=2, max_steps=2, inject_nonfinite="scale1e37@1:0")
    self.assertEqual(record["verdict"], replay_lib.REPRODUCIBLE)
    self.assertTrue(record["exclude"])
    self.assertEqual(record["control"], {"source": "step", "tower": 1,
                                         "finite": True})
    self.assertEqual(summary["forensics"]["verdicts"], {"reproducible": 1})
    ids, excluded = exclusion.excluded(train_dir)
    self.assertEqual(ids, sorted(record["towers"][0]["example_ids"]))
    self.assertEqual(excluded["by_reason"], {"reproducible_batch": 4})

  # One one-tower run proves both one-tower cases: step 0's spike has
  # nothing applied before it (undecided, nothing excluded), step 2's has
  # step 1's applied batch to compare with (the data).
  def testOneTowerComparesWithTheLastAppliedBatchIfThereIsOne(self):
    train_dir = os.path.join(self.get_temp_dir(), "one_tower")
    summary = _train(train_dir, num_towers=1,
                     inject_nonfinite="scale1e37@0,scale1e37@2")
    first, applied = skip_log.read_all(train_dir)
    for record in (first, applied):
      self.assertTrue(record["reproduced"])
      self.assertEqual(record["replay"]["input_ids"], [])  # A finite input.
    self.assertEqual((first["step"], applied["step"]), (0, 2))
    self.assertEqual(summary["forensics"]["verdicts"],
                     {"undecided": 1, "reproducible": 1})
    # Nothing applied yet: nothing says it is the data.
    self.assertEqual(first["verdict"], replay_lib.UNDECIDED)
    self.assertFalse(first["exclude"])
    self.assertNotIn("control", first)
    # The last applied batch (step 1) passes on the same weights.
    self.assertEqual(applied["verdict"], replay_lib.REPRODUCIBLE)
    self.assertTrue(applied["exclude"])
    self.assertEqual(applied["control"]["source"], "last_applied_batch")
    self.assertEqual(applied["control"]["step"], 1)
    self.assertTrue(applied["control"]["finite"])
    self.assertIn("the last applied batch (step 1) is finite",
                  replay_lib.line(2, applied))
    # Only step 2's batch is excluded, none of step 0's.
    ids, _ = exclusion.excluded(train_dir)
    self.assertEqual(ids, sorted(applied["towers"][0]["example_ids"]))
    self.assertLen(ids, 4)
    self.assertEqual(
        set(ids) & set(first["towers"][0]["example_ids"]), set())

  def testModelVerdictRollsBackAtOnce(self):
    # Step 0 (applied) wrecks the weights; each later step is a skip whose
    # replay says the model: a rollback right away (not after 50 skips),
    # until --max_rollbacks are used up, then the run stops on it.
    train_dir = os.path.join(self.get_temp_dir(), "rollback")
    summary = _train(train_dir, num_towers=1, optimizer="sgd",
                     learning_rate=1e38, inject_nonfinite="", max_steps=20,
                     save_checkpoints_steps=1, on_persistent_skips="rollback",
                     rollback_min_applied_steps=1, max_rollbacks=2)
    self.assertEqual(summary["exit_reason"], "model_fault")
    self.assertEqual(summary["rollback_count"], 2)
    self.assertEqual([(r["at_step"], r["checkpoint"])
                      for r in summary["rollbacks"]],
                     [(2, "model.ckpt-0"), (4, "model.ckpt-0")])
    self.assertIn("--max_rollbacks=2 used up", summary["rollback_refused"])
    self.assertEqual(summary["model_fault_step"], 5)
    self.assertEqual(summary["global_step"], 6)
    self.assertEqual(summary["forensics"]["verdicts"], {"model": 3})


if __name__ == "__main__":
  tf.test.main()
