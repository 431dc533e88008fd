"""Crash and resume: SIGKILL at random moments never costs more than a resume.

The trainer runs as a process under a fault drill and is killed with SIGKILL
several times: during start-up, a random delay into training, and while a
checkpoint is being written (the process is frozen with SIGSTOP the moment a
checkpoint's temporary file appears, and killed only if the write is still
in progress). After every kill, each checkpoint the `checkpoint` file lists
must be complete, finite and hold the exact counters of its step, and the
latest step never goes backwards; the next run resumes from it. A last run
(in-process, as is its rerun: resuming is the library's) finishes at
--max_steps with the exact counters of an uninterrupted run, and a run
restored at --max_steps (a rerun, or a crash after the final checkpoint)
trains no further.
"""

import os
import random
import re
import signal
import tempfile
import time
import unittest

from absl import logging
import tensorflow as tf

from tests.fixtures import forked_trainer
from tests.fixtures import reliability as lib
from tests.fixtures import train_dirs
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_MAX_STEPS = 50
_CHECKPOINT_EVERY = 5
_NUM_TOWERS = 2
_SPEC = "nan%0.1:0,inf%0.1:1"
_SEED = 3
_KILL_SEED = 20240607
# The moments of the kills, in order: at a random step of training (3 to 15
# steps after the resumed one, plus up to 50 ms); while re-writing the restored
# checkpoint (the checkpoint hook saves once when the session starts); a random
# 0.5 to 4 s after launch (start-up: imports, graph, restore); while writing a
# new checkpoint.
_KILLS = ("training", "resave", "startup", "training", "new_checkpoint")
# A checkpoint write in progress: TensorFlow's BundleWriter writes
# '<prefix>.{index,data-...}.tempstate<N>' and renames them when done.
_IN_PROGRESS = ".tempstate"
_STEP = re.compile(r"^model\.ckpt-(\d+)\.")

# The trainers killed after start-up fork from one server that imported
# TensorFlow once (tests/fixtures/forked_trainer.py); the one killed during
# start-up starts afresh, so that its kill can land in TensorFlow's import too.
_server = forked_trainer.shared
tearDownModule = forked_trainer.close_shared


def _args(train_dir):
  # No replay of the skips (--max_explained_skips=0): the claims are the
  # checkpoints' and the counters'; skips.jsonl is still written.
  return [
      "--train_dir=" + train_dir, "--num_towers=%d" % _NUM_TOWERS,
      "--device=cpu", "--batch_size=4", "--max_steps=%d" % _MAX_STEPS,
      "--save_checkpoints_steps=%d" % _CHECKPOINT_EVERY,
      "--save_summaries_steps=1000", "--log_every_n_steps=1",
      "--inject_nonfinite=" + _SPEC, "--inject_into=grads",
      "--max_consecutive_skips=0", "--max_explained_skips=0",
      "--seed=%d" % _SEED,
  ]


def _params(train_dir):
  """`_args` as params, for the runs made in-process."""
  return params_lib.TrainParams(
      train_dir=train_dir, num_towers=_NUM_TOWERS, device="cpu",
      batch_size=4, max_steps=_MAX_STEPS,
      save_checkpoints_steps=_CHECKPOINT_EVERY, save_summaries_steps=1000,
      log_every_n_steps=1, inject_nonfinite=_SPEC, inject_into="grads",
      max_consecutive_skips=0, max_explained_skips=0, seed=_SEED).validate()


def _writes_in_progress(train_dir):
  """{name: checkpoint step} of the checkpoint files being written."""
  try:
    names = os.listdir(train_dir)
  except FileNotFoundError:
    return {}
  return {n: int(_STEP.match(n).group(1)) for n in names
          if _IN_PROGRESS in n and _STEP.match(n)}


def _kill_during_checkpoint_write(process, train_dir, wanted, timeout=240):
  """Freezes the trainer mid-write and kills it.

  Args:
    process: the trainer.
    train_dir: its --train_dir.
    wanted: predicate on the step of the checkpoint being written.
    timeout: seconds to wait for such a write.

  Returns:
    The step of the checkpoint being written when the kill came, or None if
    no wanted write was caught before the process ended or the timeout.
  """
  stale = set(_writes_in_progress(train_dir))  # Leftovers of earlier kills.

  def writing():
    return {n: s for n, s in _writes_in_progress(train_dir).items()
            if n not in stale and wanted(s)}

  deadline = time.time() + timeout
  while time.time() < deadline and process.poll() is None:
    if writing():
      lib.send(process, signal.SIGSTOP)
      caught = writing()
      if caught:
        lib.kill_and_reap(process)
        return max(caught.values())
      lib.send(process, signal.SIGCONT)  # The write finished meanwhile.
    time.sleep(0.002)
  lib.kill_and_reap(process)
  return None


class CrashResumeTest(tf.test.TestCase):

  def assertCheckpointsSound(self, train_dir, drill, context):
    """Every listed checkpoint is finite with exact counters; returns steps."""
    steps = []
    for path in train_dirs.checkpoint_paths(train_dir):
      values = train_dirs.checkpoint_values(path)
      self.assertEqual(train_dirs.nonfinite_entries(values), [], path)
      counters = lib.checkpoint_counters(values)
      self.assertEqual(counters,
                       drill.expected_counters(counters["global_step"]),
                       "%s: %s" % (context, path))
      steps.append(counters["global_step"])
    self.assertEqual(steps, sorted(steps), context)
    return steps

  def testSigkillAtRandomMomentsThenResumeToMaxSteps(self):
    rng = random.Random(_KILL_SEED)
    drill = lib.Drill(_SPEC, _NUM_TOWERS, _SEED)
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    logs = tempfile.mkdtemp(dir=self.get_temp_dir())
    latest, history = 0, []
    for i, moment in enumerate(_KILLS):
      log = os.path.join(logs, "run%d.log" % i)
      if moment == "startup":
        process = lib.start_trainer(_args(train_dir), log)
      else:
        process = _server().start(_args(train_dir), log)
      try:
        if moment == "startup":
          time.sleep(rng.uniform(0.5, 4.0))
          lib.kill_and_reap(process)
        elif moment == "training":
          target = latest + rng.randint(3, 15)
          self.assertTrue(lib.wait_until(
              lambda: max(lib.progress_steps(lib.read_text(log)) or [0]) >=
              target, 240, interval=0.01, process=process),
                          lib.read_text(log))
          time.sleep(rng.uniform(0.0, 0.05))
          lib.kill_and_reap(process)
        elif moment == "resave":
          # The re-write of the resumed checkpoint at start-up is quick; on a
          # loaded machine the poll may miss it, and then the kill comes in
          # the next checkpoint write instead.
          step = _kill_during_checkpoint_write(
              process, train_dir, lambda s, at=latest: s >= at)
          self.assertIsNotNone(step, lib.read_text(log))
          self.assertGreaterEqual(step, latest)
        else:
          step = _kill_during_checkpoint_write(
              process, train_dir, lambda s, at=latest: s > at)
          self.assertIsNotNone(step, lib.read_text(log))
      finally:
        if process.poll() is None:
          lib.kill_and_reap(process)
      context = "after kill %d (%s)" % (i, moment)
      self.assertEqual(process.returncode, -signal.SIGKILL,
                       "%s: %s" % (context, lib.read_text(log)))
      steps = self.assertCheckpointsSound(train_dir, drill, context)
      now = steps[-1] if steps else 0
      self.assertGreaterEqual(now, latest, context)  # Never backwards.
      self.assertEqual(train_dirs.latest_checkpoint(train_dir) is None,
                       not steps)
      text = lib.read_text(log)
      restored = re.findall(r"Restoring parameters from (\S+)", text)
      if lib.progress_steps(text):  # It got as far as training.
        self.assertLen(restored, 1 if latest else 0, context)
      if restored:
        # It resumed from the checkpoint the previous kill left.
        self.assertEqual(restored, [os.path.join(
            train_dir, "model.ckpt-%d" % latest)], context)
      history.append((moment, now, sorted(_writes_in_progress(train_dir))))
      latest = now

    logging.info("kills (moment, latest checkpoint, in-progress files): %s",
                 history)
    self.assertLess(latest, _MAX_STEPS, "the kills came too late: %s" %
                    history)

    # The last run and its rerun, in-process (the same flags as params):
    # resuming is the library's; the kills above are the binary's.
    first = train_lib.train(_params(train_dir))
    summary = train_dirs.read_run_summary(train_dir)
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(summary["steps_this_run"], _MAX_STEPS - latest)
    self.assertEqual(lib.summary_counters(summary),
                     drill.expected_counters(_MAX_STEPS))
    self.assertEqual(summary["applied_steps"] + summary["skipped_steps"],
                     _MAX_STEPS)
    self.assertEqual(summary["skipped_steps"],
                     len(drill.poisoned(0, _MAX_STEPS)[1]))
    steps = self.assertCheckpointsSound(train_dir, drill, "final")
    self.assertEqual(steps[-1], _MAX_STEPS)
    self._check_rerun_of_finished_run(train_dir, drill, first)

  def _check_rerun_of_finished_run(self, train_dir, drill, first):
    """A run restored at --max_steps (a rerun, or a crash after the end)."""
    second = train_lib.train(_params(train_dir))
    # Regression test (fixed in tf1_safe_train/trainer/run/train_lib.py, train):
    # it stopped with tf1.train.StopAtStepHook, which decides only after a
    # step, so a run restored at --max_steps trained one more step (+1 per
    # rerun). Fix: hooks.StopAtStepHook(params.max_steps) instead.
    values = train_dirs.checkpoint_values(
        train_dirs.latest_checkpoint(train_dir))
    self.assertEqual(lib.checkpoint_counters(values),
                     drill.expected_counters(_MAX_STEPS))
    # Regression test (fixed in tf1_safe_train/trainer/run/train_lib.py,
    # _run_summary): when no step ran it wrote {"global_step": null} without
    # counters over the finished run's summary. Fix: the restored
    # checkpoint's counters, with steps_this_run 0.
    self.assertEqual(second["exit_reason"], "max_steps")
    self.assertEqual(lib.summary_counters(second), lib.summary_counters(first))
    self.assertEqual(second["steps_this_run"], 0)


if __name__ == "__main__":
  tf.test.main()
