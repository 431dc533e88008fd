"""--on_persistent_skips=rollback: roll back instead of giving up.

A drill poisons a contiguous window of global steps 20-25; with
--max_consecutive_skips=4 the streak reaches 4 after step 23, the run
restores the newest checkpoint at least 5 applied steps before the streak
(model.ckpt-15), skips the two poisoned steps left, and finishes. Every
count is exact: 40 batches = 29 applied + 6 skipped + 5 rolled back.
"""

import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from tests.fixtures import train_dirs
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import replication
from tf1_safe_train.core import criteria
from tf1_safe_train.trainer.recovery import checkpoint_rollback
from tf1_safe_train.trainer.recovery import checkpoint_rollback_target
from tf1_safe_train.trainer.inputs import checkpoint_rollback_window
from tf1_safe_train.trainer.checkpoint import checkpoints
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.recovery import state_rules
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_WEIGHT = "small_cnn/conv1/weights"


class _Weights(tf1.train.SessionRunHook):
  """{global_step after each run: a weight}, read after every hook ran."""

  def __init__(self):
    self.by_step = {}
    self._reads = None

  def begin(self):
    weight, = [v for v in tf1.global_variables() if v.op.name == _WEIGHT]
    self._reads = [tf1.train.get_global_step().read_value(),
                   weight.read_value()]

  def after_run(self, run_context, run_values):
    step, weight = run_context.session.run(self._reads)
    self.by_step[int(step)] = weight


class _FedIds(tf1.train.SessionRunHook):
  """{global step: the example ids its towers read} (from the batch store)."""

  def __init__(self):
    self.by_step = {}

  def begin(self):
    self._reads = [tf1.train.get_global_step().read_value()] + [
        v.read_value() for v in tf1.local_variables()
        if v.name.startswith("batch_store/") and v.name.endswith("/ids:0")]

  def after_run(self, run_context, run_values):
    step, *ids = run_context.session.run(self._reads)  # After the step.
    self.by_step[int(step) - 1] = set(int(i) for t in ids for i in t)


def _params(train_dir, **changes):
  # One tower of 4 examples: the claims are not about towers, and a step
  # reads the 4 examples two towers of 2 would.
  values = dict(
      train_dir=train_dir, num_towers=1, device="cpu", batch_size=4,
      max_steps=40, save_checkpoints_steps=5, save_summaries_steps=1000,
      log_every_n_steps=1000, inject_nonfinite="nan@20-25:0",
      max_consecutive_skips=4, on_persistent_skips="rollback",
      rollback_min_applied_steps=5, max_rollbacks=2)
  values.update(changes)
  return params_lib.TrainParams(**values).validate()


# Runs that several tests check or resume (each from a copy): trained once
# per file, by name.
_RUNS = {}
# The rollback run of the docstring (learning rate halved), which
# testRollsBackOnceSkipsTheWindowAndFinishes checks; its skips explained, as
# a user's run would.
_ROLLED_BACK_CHANGES = dict(rollback_halve_learning_rate=True,
                            save_summaries_steps=10)
# No checkpoint old enough: gives up at step 24 having never rolled back.
# Neither it nor the other runs below looks at the skips' explanations.
_NOT_ROLLED_BACK_CHANGES = dict(rollback_min_applied_steps=100,
                                max_explained_skips=0)


def _shared_run(name, **changes):
  """{train_dir, summary, weights, fed}: run `name` of `_params(changes)`,
  with its weights and fed ids by step (trained on first use)."""
  if name not in _RUNS:
    train_dir = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    weights, fed = _Weights(), _FedIds()
    summary = train_lib.train(_params(train_dir, **changes),
                              extra_hooks=[weights, fed])
    _RUNS[name] = dict(train_dir=train_dir, summary=summary,
                       weights=weights.by_step, fed=fed.by_step)
  return _RUNS[name]


def _rolled_back_run():
  return _shared_run("rolled_back", **_ROLLED_BACK_CHANGES)


def _not_rolled_back_run():
  return _shared_run("not_rolled_back", **_NOT_ROLLED_BACK_CHANGES)


def _stopped_run():
  """{train_dir, summary}: `_not_rolled_back_run` (copied) resumed with
  stop and a new streak (steps 26-29): it gives up at step 30 (trained on
  first use). testARunThatNeverRolledBackResumesWithStop checks it,
  testARunThatGaveUpResumesWithRollback resumes it (a copy)."""
  if "stopped" not in _RUNS:
    train_dir = os.path.join(tempfile.mkdtemp(dir=tf1.test.get_temp_dir()),
                             "run")
    shutil.copytree(_not_rolled_back_run()["train_dir"], train_dir)
    summary = train_lib.train(_params(
        train_dir, on_persistent_skips="stop", inject_nonfinite="nan@26-:0",
        max_explained_skips=0))
    _RUNS["stopped"] = dict(train_dir=train_dir, summary=summary)
  return _RUNS["stopped"]


class RollbackRunTest(tf.test.TestCase):

  def _train(self, **changes):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    weights = _Weights()
    summary = train_lib.train(_params(train_dir, **changes),
                              extra_hooks=[weights])
    return train_dir, summary, weights.by_step

  def _copy_of(self, run):
    train_dir = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), "run")
    shutil.copytree(run["train_dir"], train_dir)
    return train_dir

  def assertCheckpointsConsistent(self, train_dir):
    """Finite, counts add up, global_step only grows; returns the last."""
    checked = train_dirs.assert_rollback_checkpoints(self, train_dir)
    return checked[-1][1] if checked else None

  def testRollsBackOnceSkipsTheWindowAndFinishes(self):
    run = _rolled_back_run()
    train_dir, summary, weights = (run[k] for k in ("train_dir", "summary",
                                                    "weights"))
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(
        [summary[k] for k in ("global_step", "applied_steps", "skipped_steps",
                              "rolled_back_steps", "rollback_count")],
        [40, 29, 6, 5, 1])
    self.assertEqual(summary["rollbacks"], [{
        "at_step": 24, "to_step": 15, "checkpoint": "model.ckpt-15",
        "batches_skipped": 9, "data_window": [15, 23],
        "window_examples": 36, "window_steps_without_ids": 0,
        "applied_steps_undone": 5, "rollbacks_left": 1,
        "learning_rate_multiplier": 0.5}])
    self.assertNotIn("rollback_refused", summary)
    # The model after the rollback is the one of model.ckpt-15 (the state
    # after step 14), the skips of steps 24 and 25 left it so, and step 26
    # trained again.
    self.assertAllEqual(weights[24], weights[15])
    self.assertAllEqual(weights[26], weights[15])
    self.assertNotAllClose(weights[27], weights[26])
    final = self.assertCheckpointsConsistent(train_dir)
    self.assertEqual(int(final["global_step"]), 40)
    self.assertEqual(int(final["rollbacks"]), 1)
    self.assertEqual(float(final["learning_rate_multiplier"]), 0.5)
    self.assertEqual(
        train_dirs.scalars(train_dir, "skips/rollbacks")[-1][1], 1.0)

  def testARestartNeverFeedsTheWindowAgain(self):
    train_dir = self._copy_of(_rolled_back_run())
    fed = _rolled_back_run()["fed"]
    # Recorded durably: every batch of steps 15-23, not only the last.
    (at_step, window), = checkpoint_rollback_window.excluded_ids(train_dir)
    self.assertEqual(at_step, 24)
    self.assertEqual(set(window),
                     set().union(*[fed[s] for s in range(15, 24)]))
    self.assertLen(window, 36)
    # A restarted process reads its input from the start: its first 24
    # steps would feed the window (read at steps 15-23) again.
    # (Its flags are the run's, but for what it writes: no summaries, one
    # checkpoint at the end; nothing here reads them.)
    again = _FedIds()
    summary = train_lib.train(_params(
        train_dir, max_steps=64, **dict(
            _ROLLED_BACK_CHANGES, save_summaries_steps=1000,
            save_checkpoints_steps=100)), extra_hooks=[again])
    self.assertLen(again.by_step, 24)
    self.assertEmpty(set().union(*again.by_step.values()) & set(window))
    self.assertEqual(summary["forensics"]["excluded_examples"]["by_reason"],
                     {"rollback_window": 36})

  # The run of --max_rollbacks=1 used up (stop after the last rollback):
  # reliability_rollback_test's
  # testSigkillAtAndAfterTheRollbackThenResumeToTheEnd runs it as //:train
  # (killed and resumed) and checks its line, run_summary.json and
  # checkpoints.

  def testStopsWhenNoCheckpointIsOldEnough(self):
    summary = _not_rolled_back_run()["summary"]
    self.assertEqual(summary["exit_reason"], "too_many_consecutive_skips")
    self.assertEqual(summary["global_step"], 24)
    self.assertEqual(summary["rollbacks"], [])
    self.assertEqual(
        summary["rollback_refused"], "no rollback: the run has 20 applied "
        "steps, and a rollback needs a checkpoint written at least 100 "
        "applied steps before the skip streak "
        "(--rollback_min_applied_steps=100); there can be none yet: lower "
        "--rollback_min_applied_steps")

  def testAThirdRollbackGoesBackPastTheFirstsCheckpoint(self):
    # Saves every 5 steps, streaks of 2, M = 2. Rollback 1 at step 14 (12
    # applied) restores model.ckpt-10; rollback 2 at 22 (16 applied)
    # restores model.ckpt-15, written after rollback 1 (11 applied);
    # rollback 3 at 24 (still 11) needs at most 9 applied: model.ckpt-5,
    # written before any rollback, the only such ancestor (model.ckpt-20 of
    # the window rollback 2 abandoned is not one).
    # The same run proves two claims of its own: rollback 3 comes after the
    # last step (--max_steps=24) and is in the summary and the last
    # checkpoint; and in fp16 the streak that counts is the skips at the
    # floor loss scale (1 here from the start), as for giving up, and it
    # rolls back. (Training on after a rollback: the docstring's run.)
    train_dir, summary, weights = self._train(
        inject_nonfinite="nan@12-13:0,nan@20-23:0", max_steps=24,
        max_consecutive_skips=2, rollback_min_applied_steps=2,
        max_rollbacks=3, precision="fp16", initial_loss_scale=1.0,
        max_explained_skips=0)
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(
        [(r["at_step"], r["checkpoint"], r["applied_steps_undone"])
         for r in summary["rollbacks"]],
        [(14, "model.ckpt-10", 2), (22, "model.ckpt-15", 5),
         (24, "model.ckpt-5", 6)])
    counts = [summary[k] for k in (
        "global_step", "applied_steps", "skipped_steps", "rolled_back_steps",
        "consecutive_skips", "rollback_count")]
    self.assertEqual(counts, [24, 5, 6, 13, 0, 3])
    self.assertAllEqual(weights[24], weights[5])
    self.assertEqual(
        [step for step, _ in
         checkpoint_rollback_window.excluded_ids(train_dir)],
        [14, 22, 24])
    final = self.assertCheckpointsConsistent(train_dir)
    self.assertEqual([int(final[k]) for k in (
        "global_step", "applied_steps", "skipped_steps", "rolled_back_steps",
        "consecutive_skips", "rollbacks")], counts)
    self.assertEqual(int(final["rollback_to_step"]), 5)

  def testARunThatGaveUpResumesWithRollback(self):
    # The run that gave up with stop (`_stopped_run`: streak 26-29): its
    # latest checkpoints lack the rollback state, which starts fresh; the
    # streak goes on (step 30 skipped: 5 in a row) and the rollback restores
    # one of them (written without `rollbacks`: an ancestor), model.ckpt-24:
    # --rollback_min_applied_steps=2 makes it the newest that qualifies
    # (with 5, it would be model.ckpt-20, written with the rollback state).
    stopped = _stopped_run()
    train_dir = self._copy_of(stopped)
    self.assertNotIn("rollbacks", train_dirs.checkpoint_values(
        os.path.join(train_dir, "model.ckpt-24")))
    again = _Weights()
    summary = train_lib.train(_params(
        train_dir, inject_nonfinite="nan@26-31:0", rollback_min_applied_steps=2,
        max_explained_skips=0), extra_hooks=[again])
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(
        [summary[k] for k in ("global_step", "applied_steps", "skipped_steps",
                              "rolled_back_steps", "rollback_count")],
        [40, 28, 10, 2, 1])
    (record,) = summary["rollbacks"]
    self.assertEqual([record[k] for k in (
        "at_step", "to_step", "checkpoint", "applied_steps_undone")],
                     [31, 24, "model.ckpt-24", 2])
    self.assertEqual(summary["learning_rate_multiplier"], 1.0)
    # model.ckpt-24 holds the state after step 23 of the first run.
    self.assertAllEqual(again.by_step[31],
                        _not_rolled_back_run()["weights"][24])
    for path in train_dirs.checkpoint_paths(train_dir):
      values = train_dirs.checkpoint_values(path)
      self.assertEqual(int(values["global_step"]),
                       int(values["applied_steps"]) +
                       int(values["skipped_steps"]) +
                       int(values.get("rolled_back_steps", 0)), path)

  def testARunThatRolledBackIsRefusedWithStop(self):
    # Without rollback the graph has no rolled_back_steps nor multiplier:
    # its checkpoints would break the counters' sum and restore the rate.
    train_dir = self._copy_of(_rolled_back_run())
    with self.assertRaisesRegex(
        checkpoints.CheckpointError,
        r"^cannot resume from .*model.ckpt-40 with --on_persistent_skips="
        r"stop: the run rolled back 1 time \(5 applied steps undone\)"):
      train_lib.train(_params(train_dir, max_steps=45,
                              on_persistent_skips="stop"))

  def testARunThatNeverRolledBackResumesWithStop(self):
    # The run that found no checkpoint old enough (rollback on, its
    # checkpoints hold the rollback state, no rollback done), resumed with
    # stop: it trains on from its counters (steps 24 and 25 applied) and
    # gives up at the next streak, as stop does.
    summary = _stopped_run()["summary"]
    self.assertEqual(summary["exit_reason"], "too_many_consecutive_skips")
    self.assertEqual(
        [summary[k] for k in ("global_step", "steps_this_run",
                              "applied_steps")], [30, 6, 22])
    # Without rollback the graph has no rollback state (a claim of its own,
    # on this run).
    self.assertNotIn("rollbacks", summary)
    self.assertNotIn("rolled_back_steps", train_dirs.checkpoint_values(
        train_dirs.latest_checkpoint(_stopped_run()["train_dir"])))


class RollbackWindowTest(tf.test.TestCase):

  def testRingKeepsTheLastStepsAndCountsTheOthers(self):
    ring = checkpoint_rollback_window.IdsRing(capacity=3)
    for step in range(5):
      ring.add(step, [np.array([10 * step]), np.array([10 * step + 1])])
    ring.add(4, [np.array([99])])  # A skip that did not advance the step.
    self.assertEqual(ring.window(1, 4), ([20, 21, 30, 31, 40, 41, 99], 1))

  def testEveryRecordCountsAndATornLastLineIsIgnored(self):
    train_dir = self.get_temp_dir()
    checkpoint_rollback_window.append(train_dir, 24, [15, 23], [1, 2], 0)
    # Re-done:
    checkpoint_rollback_window.append(train_dir, 24, [15, 23], [3], 2)
    with open(checkpoint_rollback_window.path(train_dir), "a") as f:
      f.write('{"step": 30, "exam')
    self.assertEqual(checkpoint_rollback_window.excluded_ids(train_dir),
                     [(24, [1, 2]), (24, [3])])


# tests/, the folder above this file's named "tests" (it may sit at any depth
# in the tests' mirror of the package): a rule names a test by its path there.
_TESTS = os.path.abspath(__file__)
while os.path.basename(_TESTS) != "tests":
  _TESTS = os.path.dirname(_TESTS)


class StateRulesTest(tf.test.TestCase):
  """The one list of what a restart and a rollback keep (`state_rules`)."""

  def testTheDocsTablesAreTheList(self):
    root = os.path.join(_TESTS, os.pardir)
    table = "\n".join(state_rules.table())
    for doc in ("trainer.md", "checkpoints.md"):
      with open(os.path.join(root, "docs", doc)) as f:
        self.assertIn("\n" + table + "\n", f.read(), doc)

  def testEveryRuleNamesTestsThatExist(self):
    # A renamed or removed test cannot leave a rule (and the docs' table)
    # pointing at nothing.
    for rule in state_rules.RULES:
      self.assertTrue(rule.test, rule.state)
      for name in rule.test:
        path, cls, test = name.split("::")
        with open(os.path.join(_TESTS, path)) as f:
          text = f.read()
        self.assertIn("class %s(" % cls, text, name)
        self.assertIn("def %s(" % test, text, name)

  def testARollbackKeepsTheHistoryAndRestoresTheModel(self):
    with tf.Graph().as_default():
      global_step = tf1.train.get_or_create_global_step()
      for name in ("applied_steps", "consecutive_skips", "rejected_by_tower",
                   "suspect_faults_by_tower", "rollbacks",
                   "small_cnn/conv1/weights", "loss_scale"):
        tf1.Variable(0, name=name)
      criteria.counter("spike_skips")
      kept = sorted(v.op.name for v in state_rules.kept_on_rollback())
      self.assertEqual(kept, [
          "consecutive_skips", "global_step", "rejected_by_tower",
          "rollbacks", "spike_skips", "suspect_faults_by_tower"])
      # A counter of the step in no rule: the rollback refuses to build.
      self.assertEqual(state_rules.unlisted(
          [tf1.Variable(0, name="new_counter"), global_step]),
                       ["new_counter"])


class RollbackParamsTest(tf.test.TestCase):

  def testBadValuesAreRefusedInOneLine(self):
    for changes, message in (
        (dict(on_persistent_skips="retry"), "--on_persistent_skips='retry'"),
        (dict(max_rollbacks=0), "--max_rollbacks=0"),
        (dict(rollback_min_applied_steps=-1),
         "--rollback_min_applied_steps=-1"),
        (dict(max_consecutive_skips=0),
         "--on_persistent_skips=rollback needs --max_consecutive_skips")):
      with self.subTest(changes=changes):
        with self.assertRaisesRegex(params_lib.ParamsError, message):
          _params("/tmp/unused", **changes)

  def testTrainRefusesItInAClusterBeforeAnythingStarts(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    cluster = cluster_flags.from_flags("127.0.0.1:1", "127.0.0.1:2",
                                       "worker", 0)
    params = _params(train_dir, startup_timeout_secs=2.0)
    with self.assertRaisesRegex(params_lib.ParamsError,
                                "in a cluster needs --sync_replicas"):
      train_lib.train(params, strategy=replication.make(params, cluster))
    self.assertEqual(os.listdir(train_dir), [])

  def testASyncClusterRunsIt(self):
    # tests/cluster/sync_rollback_test.py runs it.
    self.assertIsNone(checkpoint_rollback.refusal_in_cluster(
        _params("/tmp/unused", sync_replicas=True)))

  def testSaysWhyNoCheckpointQualifiesInTheFlagsTerms(self):
    params = _params("/tmp/run", rollback_min_applied_steps=200,
                     save_checkpoints_steps=100)
    self.assertEqual(
        checkpoint_rollback_target.no_checkpoint_reason(params, 540),
        "the run has 540 applied steps, and a rollback needs a checkpoint "
        "written at least 200 applied steps before the skip streak "
        "(--rollback_min_applied_steps=200), one with at most 340; /tmp/run "
        "holds no intact one: lower --rollback_min_applied_steps or save "
        "checkpoints more often (--save_checkpoints_steps=100)")
    self.assertEqual(
        checkpoint_rollback_target.no_checkpoint_reason(params, 40),
        "the run has 40 applied steps, and a rollback needs a checkpoint "
        "written at least 200 applied steps before the skip streak "
        "(--rollback_min_applied_steps=200); there can be none yet: lower "
        "--rollback_min_applied_steps")

  def testKeepsEnoughCheckpoints(self):
    # M + K = 600 + 50 steps back at one checkpoint per 100: 7 intervals.
    self.assertEqual(checkpoint_rollback_target.keep_checkpoint_max(_params(
        "/tmp/unused", rollback_min_applied_steps=600,
        max_consecutive_skips=50, save_checkpoints_steps=100)), 9)
    self.assertEqual(checkpoint_rollback_target.keep_checkpoint_max(
        _params("/tmp/unused")), 5)
    self.assertEqual(checkpoint_rollback_target.keep_checkpoint_max(_params(
        "/tmp/unused", on_persistent_skips="stop",
        rollback_min_applied_steps=600)), 5)


if __name__ == "__main__":
  tf.test.main()
