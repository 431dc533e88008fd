"""Nothing lost, nothing poisoned: finite checkpoints, sound bookkeeping, one
trainer per train_dir (issue 17, sections 1 to 3).

- An applied step that writes Inf/NaN (finite gradients, a learning rate too
  large) stops the run at the next step with one line naming the variables
  and the step; no checkpoint ever holds a non-finite value, run_summary.json
  stays strict JSON, and `//:eval` refuses non-finite weights in one line.
- A missing `checkpoint` state file, a copied run (absolute paths in its
  state file), a damaged latest checkpoint: the run resumes from the newest
  intact checkpoint of its own directory and never touches another one; a
  resume with different flags names the variable and the flag.
- A second trainer on a train_dir refuses and names the first; a SIGKILLed
  trainer leaves no stuck lock; a non-empty directory that holds no run is
  refused before anything is written.

Runs are tiny (small_cnn, one tower, batch 2 to 4, a few steps).
"""

import json
import os
import shutil
import signal
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import reliability as lib
from tests.fixtures import train_dirs
from tf1_safe_train.core import rollback
from tf1_safe_train.trainer.checkpoint import checkpoint_fit
from tf1_safe_train.trainer.checkpoint import checkpoints
from tf1_safe_train.trainer.run import eval_lib
from tf1_safe_train.trainer.checkpoint import finite_state
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import run_summary
from tf1_safe_train.trainer.run import train_dir as train_dir_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1


def _strict_json(path):
  """The JSON at `path`, refusing NaN/Infinity literals as JSON does."""

  def refuse(name):
    raise ValueError("not JSON: %s" % name)

  with open(path) as f:
    return json.load(f, parse_constant=refuse)


def _args(train_dir, *more):
  return ["--train_dir=" + train_dir, "--num_towers=1", "--device=cpu",
          "--batch_size=4", "--log_every_n_steps=1",
          "--save_summaries_steps=1000"] + list(more)


def _params(train_dir, **overrides):
  # Adam, so that an Adam run's checkpoints (testMissingStateFileAndOld-
  # AdamNamesResumeFromTheNewestCheckpoint) are the shared run's; no other
  # claim here is about the optimizer.
  values = dict(train_dir=train_dir, num_towers=1, device="cpu", batch_size=2,
                max_steps=4, save_checkpoints_steps=2, optimizer="adam",
                save_summaries_steps=1000, log_every_n_steps=1000)
  values.update(overrides)
  return params_lib.TrainParams(**values).validate()


# The finished run most tests start from (model.ckpt-{0,2,4}, `_params`'s
# defaults), trained once per file; tests copy it (`_copy_of_template`).
_TEMPLATE = []


def _copy_of_template(train_dir):
  """A copy, at `train_dir`, of the 4-step run (trained on first use)."""
  if not _TEMPLATE:
    template = os.path.join(tempfile.mkdtemp(dir=tf1.test.get_temp_dir()),
                            "template")
    train_lib.train(_params(template))
    _TEMPLATE.append(template)
  shutil.copytree(_TEMPLATE[0], train_dir)
  return train_dir


def _all_checkpoints(train_dir):
  """Every `model.ckpt-N` present (listed or not), oldest first."""
  steps = checkpoints.on_disk(train_dir)
  return [os.path.join(train_dir, steps[s]) for s in sorted(steps)]


def _rewrite_checkpoint(path, poisoned, new_path=None):
  """Saves `path`'s values, a NaN in `poisoned`, to `new_path` or `path`.

  The Saver also makes it the state file's latest checkpoint.
  """
  values = train_dirs.checkpoint_values(path)
  values[poisoned].flat[0] = np.nan
  with tf.Graph().as_default():
    saver = tf1.train.Saver(
        {n: tf1.Variable(v, name=n.replace("/", "_"))
         for n, v in values.items()})
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      saver.save(session, new_path or path)


class NonFiniteStateTest(tf.test.TestCase, binaries.OneLineErrorAssertions):

  def testInfiniteFloatParametersAreRefused(self):
    for name in ("learning_rate", "weight_decay", "clip_gradient_norm",
                 "startup_timeout_secs", "moving_average_decay",
                 "initial_loss_scale"):
      for value in (float("inf"), float("-inf"), float("nan")):
        with self.subTest(name=name, value=value):
          with self.assertRaisesRegex(params_lib.ParamsError,
                                      "--%s=.*finite" % name):
            params_lib.TrainParams(**{name: value}).validate()
    train_dir = os.path.join(self.get_temp_dir(), "inf_lr")
    result = lib.run_trainer(_args(train_dir, "--learning_rate=inf"))
    self.assertOneLineError(result, "--learning_rate=inf", exit_code=2)
    self.assertFalse(os.path.exists(train_dir))

  def testAppliedStepWritingInfStopsAtOnceAndNoCheckpointHoldsIt(self):
    # SGD at 3e38: the first step's gradients are finite, so it is applied,
    # and lr * gradient overflows float32 in softmax_linear/weights.
    train_dir = os.path.join(self.get_temp_dir(), "huge_lr")
    result = lib.run_trainer(_args(
        train_dir, "--optimizer=sgd", "--learning_rate=3e38",
        "--max_steps=60", "--save_checkpoints_steps=1",
        "--max_consecutive_skips=50"))
    self.assertOneLineError(result, "non-finite model state at step 1",
                            "applied step 0", "softmax_linear/weights",
                            "--learning_rate=3e+38", exit_code=1)
    summary = _strict_json(os.path.join(train_dir, train_dirs.RUN_SUMMARY))
    self.assertEqual(summary["exit_reason"], "nonfinite_state")
    # The checkpoint after step 0 is refused: the run stops there.
    self.assertEqual(summary["global_step"], 1)
    found = _all_checkpoints(train_dir)
    self.assertEqual([os.path.basename(p) for p in found], ["model.ckpt-0"])
    for path in found:
      values = train_dirs.checkpoint_values(path)
      self.assertEqual(train_dirs.nonfinite_entries(values), [])

  def testFirstSkipAfterAnAppliedStepChecksTheState(self):
    # No checkpoint is due: the skip at step 1 finds the state non-finite and
    # stops the run there, not after --max_consecutive_skips skipped steps
    # (and the summaries of step 1, with Inf weights, do not fail it).
    train_dir = os.path.join(self.get_temp_dir(), "huge_lr_lib")
    summary = train_lib.train(_params(
        train_dir, optimizer="sgd", learning_rate=3e38, max_steps=60,
        save_checkpoints_steps=100, max_consecutive_skips=50,
        save_summaries_steps=1))  # Weight histograms of Inf do not fail.
    self.assertEqual(summary["exit_reason"], "nonfinite_state")
    self.assertEqual(summary["global_step"], 2)
    self.assertEqual(summary["skipped_steps"], 1)
    written = _strict_json(os.path.join(train_dir, train_dirs.RUN_SUMMARY))
    self.assertIsNone(written["final_loss"])  # The skipped step's loss: NaN.
    self.assertEqual(written["nonfinite_values"], {"final_loss": "nan"})
    self.assertRegex(summary["nonfinite_state"],
                     "^non-finite model state at step 1 \\(written by applied "
                     "step 0, .*\\): small_cnn/softmax_linear/weights; likely "
                     "cause: --learning_rate=3e\\+38 ")
    self.assertEqual(
        [os.path.basename(p) for p in _all_checkpoints(train_dir)],
        ["model.ckpt-0"])

  def testEvalRefusesNonFiniteWeightsInOneLine(self):
    train_dir = _copy_of_template(os.path.join(self.get_temp_dir(),
                                               "nan_weights"))
    _rewrite_checkpoint(train_dirs.latest_checkpoint(train_dir),
                        "small_cnn/local3/weights",
                        os.path.join(train_dir, "model.ckpt-7"))
    with self.assertRaisesRegex(eval_lib.NonFiniteCheckpointError,
                                "small_cnn/local3/weights"):
      eval_lib.evaluate(params_lib.EvalParams(train_dir=train_dir,
                                              max_examples=100))
    result = binaries.run("eval", "--train_dir=" + train_dir,
                          "--max_examples=100")
    self.assertEqual(result.returncode, 1, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertStartsWith(errors[0], "eval: error: ")
    self.assertIn("model.ckpt-7", errors[0])
    self.assertIn("small_cnn/local3/weights", errors[0])

  def testRunSummaryIsStrictJson(self):
    path = run_summary.write(self.get_temp_dir(), {
        "final_loss": float("nan"), "loss_scale": float("inf"),
        "global_step": 3})
    summary = _strict_json(path)
    self.assertIsNone(summary["final_loss"])
    self.assertEqual(summary["nonfinite_values"],
                     {"final_loss": "nan", "loss_scale": "inf"})
    self.assertEqual(summary["global_step"], 3)


class FiniteSaverTest(tf.test.TestCase):

  def testRefusesToSaveANonFiniteState(self):
    # Every checkpoint hook (MonitoredTrainingSession's, a cluster chief's)
    # saves through the scaffold's saver: the check there covers them all.
    prefix = os.path.join(self.get_temp_dir(), "saver", "model.ckpt")
    refused = []
    with tf.Graph().as_default():
      v = tf1.Variable([1.0, 2.0], name="v")
      global_step = tf1.train.get_or_create_global_step()
      saver = checkpoints.FiniteSaver(
          finite_state.FiniteStateCheck(),
          lambda step, names: refused.append((step, names)))
      poison = v.assign([1.0, np.inf])
      with tf1.Session() as session:
        session.run(tf1.global_variables_initializer())
        self.assertIsNotNone(saver.save(session, prefix, global_step=3))
        session.run(poison)
        self.assertIsNone(saver.save(session, prefix, global_step=global_step))
    self.assertEqual(refused, [(0, ["v"])])
    self.assertEqual(list(checkpoints.on_disk(os.path.dirname(prefix))), [3])

  def testResumesAShadowPerVariableCheckpointIntoAFlatShadow(self):
    # Checkpoints written before statistics shared a flat shadow hold one
    # per statistic. Resumed, the flat shadow must take the restored
    # statistics: from its initial value, the first skip would undo them.
    prefix = os.path.join(self.get_temp_dir(), "per_variable", "model.ckpt")
    saved = {"bn/moving_mean": [1.0, 2.0], "bn/moving_variance": [3.0, 4.0]}
    with tf.Graph().as_default():
      old = {}
      for name, value in saved.items():
        for suffix in ("", "/skip_shadow"):
          old[name + suffix] = tf1.Variable(value)
      with tf1.Session() as session:
        session.run(tf1.global_variables_initializer())
        tf1.train.Saver(old).save(session, prefix)
    with tf.Graph().as_default():
      moving = [tf1.Variable(tf.zeros([2]), name=name, trainable=False)
                for name in saved]
      statistics = rollback.Rollback(moving)
      undo = statistics.restore()
      variables = tf1.global_variables()
      fresh = checkpoint_fit.fresh_variables(prefix, variables)
      self.assertLen(fresh, 1)
      self.assertIn("skip_shadow", fresh[0].op.name)
      saver = checkpoints.FiniteSaver(
          finite_state.FiniteStateCheck(), lambda step, names: None,
          fresh=fresh, var_list={v.op.name: v for v in variables})
      with tf1.Session() as session:
        session.run(tf1.global_variables_initializer())
        saver.restore(session, prefix)
        session.run([v.assign([np.nan, np.nan]) for v in moving])
        session.run(undo)  # A skipped step's rollback.
        self.assertAllEqual(list(saved.values()), session.run(moving))


class BookkeepingTest(tf.test.TestCase):

  def _run(self, name, **overrides):
    """A finished run in a new train_dir `name`: the file's 4-step run
    (copied) unless `overrides` change its params."""
    train_dir = os.path.join(self.get_temp_dir(), name)
    if overrides:
      train_lib.train(_params(train_dir, **overrides))
    else:
      _copy_of_template(train_dir)
    return train_dir

  def testMissingStateFileAndOldAdamNamesResumeFromTheNewestCheckpoint(self):
    # One resumed run proves two claims (each fails on its own): without
    # the state file the run resumes from the newest checkpoint, not from
    # step 0; and a checkpoint of an older trainer, whose Adam beta powers
    # were saved as "apply/beta1_power" and "apply/beta2_power" (until the
    # trainer shared the wrapper's step), is restored and carried on.
    train_dir = self._run("no_state_old_adam")  # Adam, model.ckpt-{0,2,4}.
    latest = _all_checkpoints(train_dir)[-1]
    values = train_dirs.checkpoint_values(latest)
    with tf.Graph().as_default():
      renamed = {("apply/" + n if n.endswith("_power") else n):
                 tf1.Variable(v, name=n.replace("/", "_"))
                 for n, v in values.items()}
      self.assertIn("apply/beta1_power", renamed)
      saver = tf1.train.Saver(renamed)
      with tf1.Session() as session:
        session.run(tf1.global_variables_initializer())
        saver.save(session, latest)
    # After the save, which rewrote it.
    os.remove(os.path.join(train_dir, checkpoints.STATE_FILE))
    summary = train_lib.train(_params(train_dir, max_steps=6))
    self.assertEqual(summary["global_step"], 6)
    self.assertEqual(summary["steps_this_run"], 2)  # Not 6 from step 0.
    self.assertEqual(
        [os.path.basename(p) for p in _all_checkpoints(train_dir)],
        ["model.ckpt-0", "model.ckpt-2", "model.ckpt-4", "model.ckpt-6"])
    resumed = train_dirs.checkpoint_values(_all_checkpoints(train_dir)[-1])
    # Restored and carried on (two more Adam steps), not started afresh.
    self.assertAllClose(resumed["apply/beta1_power"],
                        values["beta1_power"] * 0.9**2)
    self.assertNotIn("beta1_power", resumed)

  def testCopiedRunNeverTouchesTheOriginal(self):
    run = self._run("run")
    # As older versions wrote it: absolute paths into `run`.
    tf1.train.update_checkpoint_state(
        run, os.path.join(run, "model.ckpt-4"),
        [os.path.join(run, "model.ckpt-%d" % s) for s in (0, 2, 4)])
    copy = os.path.join(self.get_temp_dir(), "copy")
    shutil.copytree(run, copy)
    before = train_dirs.files_snapshot(run)
    # 3 more checkpoints: keep-max 5 prunes the oldest listed one, the
    # copy's model.ckpt-0 (a pruning that followed the absolute paths would
    # delete the original's).
    summary = train_lib.train(_params(copy, max_steps=10))
    self.assertEqual(summary["steps_this_run"], 6)
    self.assertEqual(train_dirs.files_snapshot(run), before)
    self.assertEqual(sorted(checkpoints.on_disk(copy)), [2, 4, 6, 8, 10])
    state = tf1.train.get_checkpoint_state(copy)
    self.assertEqual(state.model_checkpoint_path,
                     os.path.join(copy, "model.ckpt-10"))
    self.assertTrue(all(p.startswith(copy + os.sep)
                        for p in state.all_model_checkpoint_paths))
    with open(os.path.join(copy, checkpoints.STATE_FILE)) as f:
      self.assertNotIn(os.sep, f.read())  # Basenames only.
    # A moved run resumes too, from its own latest checkpoint: what
    # `train_lib.train` resumes from is `checkpoints.prepare_resume`'s choice,
    # which it writes in the state file (the run above and testMissingState-
    # FileAndOldAdamNamesResumeFromTheNewestCheckpoint's train from it).
    moved = os.path.join(self.get_temp_dir(), "moved")
    os.rename(copy, moved)
    with train_dir_lib.lock(moved):  # As train_lib.train calls it.
      resume = checkpoints.prepare_resume(moved)
    self.assertEqual(resume, os.path.join(moved, "model.ckpt-10"))
    self.assertEqual(train_dirs.latest_checkpoint(moved), resume)

  def testDamagedLatestCheckpointFallsBackWithOneWarning(self):
    # What a run resumes from is `checkpoints.prepare_resume`'s choice (its
    # warnings, the state file it writes and the run restores from: as
    # testMissingStateFileAndOldAdamNamesResumeFromTheNewestCheckpoint's run
    # proves, where TensorFlow alone would start from step 0).
    for damage in ("truncate", "zero", "nan"):
      with self.subTest(damage=damage):
        train_dir = self._run("damaged_" + damage)
        if damage == "truncate":
          (data,) = [n for n in os.listdir(train_dir)
                     if n.startswith("model.ckpt-4.data")]
          path = os.path.join(train_dir, data)
          with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        elif damage == "zero":
          path = os.path.join(train_dir, "model.ckpt-4.index")
          with open(path, "r+b") as f:
            f.write(b"\0" * os.path.getsize(path))
        else:  # As a run before the finite-state check could leave it.
          _rewrite_checkpoint(os.path.join(train_dir, "model.ckpt-4"),
                              "small_cnn/local3/weights")
        with self.assertLogs(level="WARNING") as logs:
          with train_dir_lib.lock(train_dir):  # As train_lib.train takes it.
            resume = checkpoints.prepare_resume(train_dir)
        self.assertEqual(resume, os.path.join(train_dir, "model.ckpt-2"))
        self.assertEqual(train_dirs.latest_checkpoint(train_dir), resume)
        warnings = [r.getMessage() for r in logs.records
                    if "damaged checkpoint" in r.getMessage()]
        self.assertLen(warnings, 1)
        self.assertIn("model.ckpt-4", warnings[0])
        self.assertIn("resuming from model.ckpt-2", warnings[0])

  def testNoIntactCheckpointIsRefused(self):
    train_dir = self._run("all_damaged")  # model.ckpt-{0,2,4}.
    for name in os.listdir(train_dir):
      if name.startswith("model.ckpt-") and ".data" in name:
        with open(os.path.join(train_dir, name), "wb"):
          pass
    before = train_dirs.files_snapshot(train_dir)
    with self.assertRaisesRegex(checkpoints.CheckpointError,
                                "none is intact.*model.ckpt-4.*model.ckpt-2"
                                ".*model.ckpt-0"):
      train_lib.train(_params(train_dir, max_steps=6))
    after = train_dirs.files_snapshot(train_dir)
    after.pop(train_dir_lib.LOCK_FILE)
    before.pop(train_dir_lib.LOCK_FILE)
    self.assertEqual(after, before)

  def testResumeWithOtherFlagsNamesTheVariableAndTheFlag(self):
    train_dir = self._run("flags")  # model.ckpt-4.
    cases = [
        (dict(model="resnet8"), "--model=small_cnn \\(now resnet8\\)"),
        (dict(num_towers=2), "nonfinite_steps_by_tower.*--num_towers=1"),
        (dict(precision="fp16"), "loss_scale.*--precision=fp32"),
    ]
    for overrides, expected in cases:
      with self.subTest(**overrides):
        with self.assertRaisesRegex(checkpoints.CheckpointError,
                                    "cannot resume from .*model.ckpt-4: "
                                    "variable .*" + expected):
          train_lib.train(_params(train_dir, max_steps=6, **overrides))
    # Without run_summary.json the variable's name still points at the flag
    # (the optimizer's case: the flags' values in run_summary.json are one
    # loop over them, proven by the cases above).
    os.remove(os.path.join(train_dir, train_dirs.RUN_SUMMARY))
    with self.assertRaisesRegex(checkpoints.CheckpointError,
                                "cannot resume from .*model.ckpt-4: variable "
                                ".*Momentum.*--optimizer probably differs"):
      train_lib.train(_params(train_dir, max_steps=6, optimizer="momentum"))

  def testEvalRetriesWhenItsCheckpointIsPrunedBeforeTheRestore(self):
    train_dir = self._run("eval_race")  # model.ckpt-{0,2,4}.
    real_restore = tf1.train.Saver.restore
    restored = []

    def pruned_then_restore(saver, session, save_path):
      if not restored:  # A trainer prunes it between eval's choice and now.
        prefix = os.path.basename(save_path) + "."
        for name in os.listdir(train_dir):
          if name.startswith(prefix):
            os.remove(os.path.join(train_dir, name))
      restored.append(os.path.basename(save_path))
      return real_restore(saver, session, save_path)

    with mock.patch.object(tf1.train.Saver, "restore", pruned_then_restore):
      result = eval_lib.evaluate(params_lib.EvalParams(train_dir=train_dir,
                                                       max_examples=100))
    self.assertEqual(restored, ["model.ckpt-4", "model.ckpt-2"])
    self.assertEqual(result["global_step"], 2)


class OneTrainerPerDirTest(tf.test.TestCase, binaries.OneLineErrorAssertions):

  def testSecondTrainerRefusesAndAKilledOneLeavesNoLock(self):
    train_dir = os.path.join(self.get_temp_dir(), "shared")
    log = train_dir + ".log"
    first = lib.start_trainer(_args(
        train_dir, "--max_steps=1000000", "--save_checkpoints_steps=1000000"),
        log)
    try:
      self.assertTrue(lib.wait_until(
          lambda: lib.progress_steps(lib.read_text(log)), 300, process=first),
                      lib.read_text(log))
      # Frozen, it still holds the lock, and burns no CPU while the second
      # one starts (nor writes: the snapshot below is the first's files).
      lib.send(first, signal.SIGSTOP)
      before = train_dirs.files_snapshot(train_dir)
      second = lib.run_trainer(_args(train_dir, "--max_steps=3"))
      self.assertOneLineError(second, "--train_dir=" + train_dir,
                              "in use by another trainer",
                              "pid %d" % first.pid, exit_code=2)
      # Nothing of the second one was written (events, checkpoints).
      self.assertCountEqual(train_dirs.files_snapshot(train_dir), before)
      # Regression test (issue 32, 11): train.lock deleted (a "stale lock"
      # clean-up) let a second trainer resume from the first's checkpoint
      # and write the same model.ckpt-N. The lock is the directory's.
      os.remove(os.path.join(train_dir, train_dir_lib.LOCK_FILE))
      before.pop(train_dir_lib.LOCK_FILE)
      second = lib.run_trainer(_args(train_dir, "--max_steps=3"))
      self.assertOneLineError(second, "--train_dir=" + train_dir,
                              "in use by another trainer",
                              "train.lock, which names it, was deleted",
                              exit_code=2)
      self.assertCountEqual(train_dirs.files_snapshot(train_dir), before)
    finally:
      lib.kill_and_reap(first)  # SIGKILL: no clean-up of its lock.
    self.assertEqual(first.returncode, -signal.SIGKILL)
    # Its lock is free: a run takes it (`train_dir.check` and `lock`, as
    # `train_lib.train` calls them for //:train) and holds it.
    train_dir_lib.check(train_dir)
    with train_dir_lib.lock(train_dir):
      with open(os.path.join(train_dir, train_dir_lib.LOCK_FILE)) as f:
        self.assertStartsWith(f.read(), "pid %d on host " % os.getpid())

  def testNonEmptyDirectoryWithoutARunIsRefused(self):
    foreign = os.path.join(self.get_temp_dir(), "home")
    os.makedirs(os.path.join(foreign, "photos"))
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
      f.write("mine")
    before = train_dirs.files_snapshot(foreign)
    result = lib.run_trainer(_args(foreign, "--max_steps=2"))
    self.assertOneLineError(result, "--train_dir=" + foreign, "not empty",
                            "holds no training run", exit_code=2)
    self.assertEqual(train_dirs.files_snapshot(foreign), before)
    self.assertCountEqual(os.listdir(foreign), ["photos", "notes.txt"])
    # The root directory is such a directory (checked without writing).
    with self.assertRaisesRegex(train_dir_lib.TrainDirError,
                                "--train_dir=/ is not empty"):
      train_dir_lib.check("/")
    # An empty directory (log files aside), and one holding a run, are
    # accepted.
    empty = tempfile.mkdtemp(dir=self.get_temp_dir())
    with open(os.path.join(empty, "worker0.log"), "w") as f:
      f.write("started")
    train_dir_lib.check(empty)
    with open(os.path.join(empty, "run_summary.json"), "w") as f:
      f.write("{}")
    train_dir_lib.check(empty)


if __name__ == "__main__":
  tf.test.main()
