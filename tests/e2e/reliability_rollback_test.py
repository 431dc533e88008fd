"""--on_persistent_skips=rollback as a user runs it: killed, restarted, refused.

The trainer (`//:train` as a process) runs the rollback drill of
checkpoint_rollback_test.py with a window that never ends and one rollback
allowed, and is SIGKILLed the moment the streak that triggers the rollback
is complete (the log reports its last skip, in the same hook round as the
rollback): whether the kill lands before, during or after the restore,
every listed checkpoint stays complete, finite and consistent, and the
restart resumes from the latest of them (SIGKILLed again once a checkpoint
holds the rollback, and resumed again) and ends as an uninterrupted run
would: it gives up once the last rollback is used up, saying why in one
line, with exact counts, naming the last good checkpoint of its history
(the one the rollback restored, not one of the window it abandoned). A
rollback of a three-tower run keeps the towers' history (rejected steps,
suspect faults: the third quarantines the tower), and a rerun of that
finished run keeps the rollback fields. In a cluster, and with a bad
value, the flag is refused in one line.
"""

import os
import re
import signal
import tempfile

from absl import logging
import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import forked_trainer
from tests.fixtures import reliability as lib
from tests.fixtures import train_dirs

tf1 = tf.compat.v1

# Its three trainers (two SIGKILLed mid-run, one run to its end) fork from
# one server that imported TensorFlow once
# (tests/fixtures/forked_trainer.py): the kills land mid-run, never in start-up.
_server = forked_trainer.shared
tearDownModule = forked_trainer.close_shared


def _args(train_dir):
  return [
      # One tower of 4 examples (the claims are not about towers), no
      # skip explained (nothing here reads them).
      "--train_dir=" + train_dir, "--num_towers=1", "--device=cpu",
      "--batch_size=4", "--max_steps=40", "--save_checkpoints_steps=5",
      "--save_summaries_steps=1000", "--log_every_n_steps=1",
      "--max_explained_skips=0", "--inject_nonfinite=nan@20-:0",
      "--max_consecutive_skips=4", "--on_persistent_skips=rollback",
      "--rollback_min_applied_steps=5", "--max_rollbacks=1",
  ]


class SigkillAtRollbackTest(binaries.OneLineErrorAssertions,
                            tf.test.TestCase):

  def assertConsistentCheckpoints(self, train_dir):
    """Each listed checkpoint: finite, counts adding up; returns the steps."""
    checked = train_dirs.assert_rollback_checkpoints(self, train_dir)
    for path, values in checked:
      self.assertLessEqual(int(values["rollbacks"]), 1, path)
    return [int(values["global_step"]) for _, values in checked]

  def _kill_at(self, train_dir, last_line):
    """Starts (or resumes) the run; SIGKILLs it once `last_line` is logged.

    Returns:
      (its log, the steps of the listed checkpoints after the kill, the
      rollbacks the latest of them holds).
    """
    log = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), "run.log")
    process = _server().start(_args(train_dir), log)
    try:
      self.assertTrue(lib.wait_until(
          lambda: last_line in lib.read_text(log), 240,
          interval=0.002, process=process), lib.read_text(log))
      lib.send(process, signal.SIGSTOP)
    finally:
      lib.kill_and_reap(process)
    text = lib.read_text(log)
    self.assertEqual(process.returncode, -signal.SIGKILL, text)
    steps = self.assertConsistentCheckpoints(train_dir)
    self.assertNotEmpty(steps)
    done = int(train_dirs.checkpoint_values(
        train_dirs.latest_checkpoint(train_dir))["rollbacks"])
    logging.info("killed at %r with model.ckpt-%d latest, holding %d "
                 "rollback(s)", last_line, steps[-1], done)
    return text, steps, done

  def assertResumedFrom(self, log, train_dir, step, done):
    """`log`'s run restored model.ckpt-`step` and rolled back again only if
    that checkpoint (holding `done` rollbacks) did not hold the rollback."""
    restored = re.findall(r"Restoring parameters from (\S+)", log)
    self.assertEqual(restored[0],
                     os.path.join(train_dir, "model.ckpt-%d" % step))
    self.assertLen(re.findall("rolled back at step", log), 1 - done)

  def testSigkillAtAndAfterTheRollbackThenResumeToTheEnd(self):
    # One run, killed twice, proves both kills: at the streak's last skip
    # (the rollback is about to run, or running), and once the rollback was
    # checkpointed (model.ckpt-25, written before step 24's report).
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    _, steps, done = self._kill_at(train_dir, "skipped step 23:")
    if not done:  # Killed before model.ckpt-25: the usual case.
      log, after, done_after = self._kill_at(train_dir, "skipped step 25:")
      # A rollback the latest checkpoint does not hold happens again.
      self.assertResumedFrom(log, train_dir, steps[-1], done)
      self.assertEqual(done_after, 1)
      self.assertGreaterEqual(after[-1], steps[-1])
      steps, done = after, done_after
    # The resumed run ends as the uninterrupted one would: rolled back
    # after step 23, four more skips (24-27), no rollback left.
    result = _server().run_train(_args(train_dir))
    # The last good checkpoint follows the run's history: model.ckpt-15,
    # which the rollback restored (no step applied since), not
    # model.ckpt-20, the newest before the streak by step number, written
    # in the window the rollback abandoned (issue #32, item 7).
    self.assertOneLineError(
        result, "gave up after 4 consecutive skipped steps at step 28 "
        "(--max_consecutive_skips=4); no rollback: --max_rollbacks=1 used up",
        "the streak began at step 24: model.ckpt-15 in %s, which the last "
        "rollback restored (no step applied since" % train_dir,
        exit_code=1)
    self.assertResumedFrom(result.stderr, train_dir, steps[-1], done)
    summary = train_dirs.read_run_summary(train_dir)
    self.assertEqual(summary["exit_reason"], "too_many_consecutive_skips")
    self.assertEqual(
        [summary[k] for k in ("global_step", "applied_steps", "skipped_steps",
                              "rolled_back_steps", "rollback_count")],
        [28, 15, 8, 5, 1])
    # The rollback's record is the killed process's (its rollbacks_left is
    # checkpoint_rollback_test's testRollsBackOnceSkipsTheWindowAndFinishes);
    # this process did none.
    self.assertEqual(summary["rollbacks"], [])
    self.assertEqual(summary["rollback_refused"],
                     "no rollback: --max_rollbacks=1 used up")
    self.assertEqual(summary["learning_rate_multiplier"], 1.0)
    final = self.assertConsistentCheckpoints(train_dir)
    self.assertGreaterEqual(final[-1], steps[-1])


# Three towers, a tower left out at a time (--skip_unit=tower): tower 2's
# gradients fail at steps 1 and 3 (left out, applied: its suspect faults 1,
# 2), towers 0 and 1 at steps 4-5 (too few healthy: skipped), so after step
# 5 the streak of 2 rolls back to model.ckpt-2 (at most 4 - 2 applied
# steps), written before step 3's fault; tower 2 fails again at step 6.
_TOWER_ARGS = [
    "--num_towers=3", "--device=cpu", "--batch_size=2", "--max_steps=8",
    "--skip_unit=tower", "--quarantine_after=3",
    "--inject_nonfinite=nan@1:2,nan@3:2,nan@4-5:0,nan@4-5:1,nan@6:2",
    "--max_consecutive_skips=2", "--on_persistent_skips=rollback",
    "--rollback_min_applied_steps=2", "--save_checkpoints_steps=2",
    "--save_summaries_steps=1000", "--log_every_n_steps=100"]


class TowerHistoryRollbackTest(tf.test.TestCase):
  """A rollback keeps the history (`state_rules`): the towers' counts are
  what happened, not what the restored checkpoint held (issue #32, item 6);
  a rerun of the finished run keeps the rollback fields (item 8)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.train_dir = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    cls.first = _server().run_train(["--train_dir=" + cls.train_dir] +
                                    _TOWER_ARGS)
    cls.first_summary = train_dirs.read_run_summary(cls.train_dir)
    cls.faults = train_dirs.checkpoint_values(
        train_dirs.latest_checkpoint(cls.train_dir))[
            "suspect_faults_by_tower"].tolist()
    # The run ended at --max_steps: the rerun runs no step.
    cls.rerun = _server().run_train(["--train_dir=" + cls.train_dir] +
                                    _TOWER_ARGS)
    cls.rerun_summary = train_dirs.read_run_summary(cls.train_dir)

  def testTheTowersCountsSurviveTheRollback(self):
    self.assertEqual(self.first.returncode, 0, self.first.stderr)
    self.assertIn("rolled back at step 6 to model.ckpt-2", self.first.stderr)
    summary = self.first_summary
    self.assertEqual(summary["rollback_count"], 1)
    # Tower 2's third fault (steps 1, 3, 6) quarantines it: model.ckpt-2
    # held one, the count goes on from the two of the run.
    self.assertIn("tower 2 (/device:CPU:2) quarantined: 3 faults",
                  self.first.stderr)
    self.assertEqual(summary["quarantined_towers"], [2])
    self.assertEqual(self.faults[2], 3)
    # Steps 1, 3 and 6 were applied without tower 2 (1 and 3 then undone).
    self.assertEqual(summary["rejected_by_tower"], [0, 0, 3])
    self.assertEqual(summary["nonfinite_steps_by_tower"], [2, 2, 3])

  def testARerunOfTheFinishedRunKeepsTheRollbackFields(self):
    self.assertEqual(self.rerun.returncode, 0, self.rerun.stderr)
    summary = self.rerun_summary
    self.assertEqual(summary["steps_this_run"], 0)
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(
        [summary.get(k) for k in ("rollback_count", "rolled_back_steps",
                                  "learning_rate_multiplier",
                                  "rollback_to_step")], [1, 2, 1.0, 2])
    self.assertEqual(summary["rollbacks"], [])  # None in this process.


class LastGoodAfterARollbackTest(binaries.OneLineErrorAssertions,
                                 tf.test.TestCase):

  def testPruningSparesTheCheckpointTheRollbackRestored(self):
    # A checkpoint a step, M = 1: the streak of steps 20-23 rolls back to
    # model.ckpt-19, the next (24-27) gives up. 7 checkpoints are kept
    # (keep_checkpoint_max) and 9 were written since model.ckpt-19: by
    # step number pruning would spare model.ckpt-23 (the newest before the
    # streak, of the abandoned window) and delete model.ckpt-19, the last
    # good one of the run's history.
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    args = [a for a in _args(train_dir)
            if not a.startswith(("--save_checkpoints_steps",
                                 "--rollback_min_applied_steps"))]
    result = _server().run_train(args + ["--save_checkpoints_steps=1",
                                         "--rollback_min_applied_steps=1"])
    self.assertOneLineError(
        result, "gave up after 4 consecutive skipped steps at step 28",
        "the streak began at step 24: model.ckpt-19 in %s, which the last "
        "rollback restored" % train_dir, exit_code=1)
    self.assertIn("rolled back at step 24 to model.ckpt-19", result.stderr)
    self.assertTrue(os.path.exists(
        os.path.join(train_dir, "model.ckpt-19.index")))


class RefusedTest(binaries.OneLineErrorAssertions, tf.test.TestCase):

  def testRefusedInAnAsyncClusterByEveryTask(self):
    for job in ("worker", "ps"):
      with self.subTest(job=job):
        train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
        result = binaries.run(
            "train", "--train_dir=" + train_dir,
            "--on_persistent_skips=rollback", "--ps_hosts=127.0.0.1:1",
            "--worker_hosts=127.0.0.1:2", "--job_name=" + job,
            "--task_index=0", no_tensorflow=True)  # Refused before it.
        self.assertOneLineError(
            result, "--on_persistent_skips=rollback in a cluster needs "
            "--sync_replicas", "parameter servers", exit_code=2)
        self.assertEqual(os.listdir(train_dir), [])

  # Giving up after the last rollback (its line, run_summary.json and
  # checkpoints): SigkillAtRollbackTest's resumed run.

  def testBadValueIsOneLine(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    result = binaries.run("train", "--train_dir=" + train_dir,
                          "--on_persistent_skips=rollback",
                          "--max_consecutive_skips=0",
                          no_tensorflow=True)  # Refused before it.
    self.assertOneLineError(
        result, "--on_persistent_skips=rollback needs --max_consecutive_skips",
        exit_code=2)


if __name__ == "__main__":
  tf.test.main()
