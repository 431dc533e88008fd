"""How a run ends when it cannot or must not go on: persistent fault, signals.

A fault on every step from step N on makes the trainer give up after
--max_consecutive_skips skipped steps with one error line and a non-zero exit;
its last checkpoint holds the state after step N-1, bit for bit (weights,
optimizer slots, batch-norm moving statistics, EMA shadows). SIGTERM and
Ctrl-C (SIGINT) end a run cleanly: exit 0, a final checkpoint at the step the
run summary reports (`exit_reason: "interrupted"`), and a rerun resumes there;
Ctrl-C during start-up ends with one line.
"""

import os
import signal
import tempfile
import time
import unittest

import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import forked_trainer
from tests.fixtures import reliability as lib
from tests.fixtures import train_dirs
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import stop_signals
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

_SEED = 5
# The drill of the interrupted runs: both towers, a skip every few steps.
_DRILL = "nan%0.2:0,-inf%0.1:1"

# The trainers this module runs to their end or signals mid-run (those
# signalled during start-up aside) fork from one server: one TensorFlow
# import for all of them (tests/fixtures/forked_trainer.py).
_server = forked_trainer.shared
tearDownModule = forked_trainer.close_shared


def _common_args(train_dir):
  return ["--train_dir=" + train_dir, "--num_towers=2", "--device=cpu",
          "--batch_size=4", "--save_summaries_steps=1000", "--seed=%d" % _SEED]


class PersistentFaultTest(tf.test.TestCase):

  def _check_give_up(self, train_dir, n, k, expect_names):
    """Checks what a run that gave up at step n + k left in `train_dir`."""
    summary = train_dirs.read_run_summary(train_dir)
    self.assertEqual(summary["exit_reason"], "too_many_consecutive_skips")
    self.assertEqual(
        (summary["global_step"], summary["applied_steps"],
         summary["skipped_steps"], summary["consecutive_skips"]),
        (n + k, n, k, k))

    last = train_dirs.latest_checkpoint(train_dir)
    self.assertEqual(last, os.path.join(train_dir, "model.ckpt-%d" % (n + k)))
    before = train_dirs.checkpoint_values(
        os.path.join(train_dir, "model.ckpt-%d" % n))
    after = train_dirs.checkpoint_values(last)
    self.assertEqual(int(before["global_step"]), n)
    self.assertEqual(int(before["applied_steps"]), n)
    self.assertEqual(int(after["skipped_steps"]), k)
    self.assertEqual(train_dirs.nonfinite_entries(after), [])
    state_before, state_after = lib.model_state(before), lib.model_state(after)
    self.assertCountEqual(state_after, state_before)
    for pattern in expect_names:  # The comparison covers what it must.
      self.assertTrue(any(pattern in name for name in state_after),
                      "no %r in %s" % (pattern, sorted(state_after)))
    for name, value in state_after.items():
      self.assertEqual(value.dtype, state_before[name].dtype, name)
      # Bit for bit: compare the bytes, not the values (NaN != NaN).
      self.assertEqual(value.tobytes(), state_before[name].tobytes(), name)

  # The binary: one error line naming the give-up, exit code 1.
  def testSmallCnnMomentumGradsFaultOnTower1(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    n, k = 10, 4
    result = _server().run_train(_common_args(train_dir) + [
        "--max_steps=1000", "--save_checkpoints_steps=%d" % n,
        "--max_consecutive_skips=%d" % k, "--log_every_n_steps=1000",
        "--inject_nonfinite=nan@10-:1", "--inject_into=grads",
        "--optimizer=momentum"])
    # One error line, last, naming the give-up; non-zero exit; no traceback.
    self.assertEqual(result.returncode, 1, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertEqual(binaries.our_lines(result.stderr)[-1], errors[0])
    self.assertStartsWith(errors[0], "train: error: gave up after %d "
                          "consecutive skipped steps at step %d" % (k, n + k))
    self.assertIn("--max_consecutive_skips=%d" % k, errors[0])
    self._check_give_up(train_dir, n, k,
                        ["small_cnn/conv1/weights", "/Momentum"])

  # The library (the binary's line and exit code are the test above's; its
  # counts are the summary's, checked here): resnet8, for its batch norm
  # (resnet20's layer kinds at a third of the graph). Tower 0's update ops
  # write the batch-norm moving statistics; Adam has slots and beta powers;
  # the EMA has shadows: none may move.
  def testResnetAdamEmaInputFaultOnTower0(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    n, k = 4, 3
    summary = train_lib.train(params_lib.TrainParams(
        train_dir=train_dir, num_towers=2, device="cpu", batch_size=4,
        save_summaries_steps=1000, seed=_SEED, max_steps=1000,
        save_checkpoints_steps=n, max_consecutive_skips=k,
        log_every_n_steps=1000, model="resnet8",
        inject_nonfinite="inf@4-:0", inject_into="input", optimizer="adam",
        moving_average_decay=0.99).validate())
    self.assertEqual(summary["exit_reason"], "too_many_consecutive_skips")
    self._check_give_up(
        train_dir, n, k,
        ["moving_mean", "moving_variance", "/Adam", "beta1_power",
         "ExponentialMovingAverage"])


# `//:train`'s main with one more hook: at the third step it fetches a
# 4 TiB tensor, a real ResourceExhaustedError from TensorFlow's allocator
# (malloc fails at once, nothing is really allocated; the size is fed, so no
# graph optimisation folds it).
_OOM_DRIVER = r"""
from absl import app
import tensorflow as tf
from tf1_safe_train import cli, train
from tf1_safe_train.trainer.run import train_lib
tf1 = tf.compat.v1

class HugeFetchHook(tf1.train.SessionRunHook):
  def begin(self):
    self._size = tf1.placeholder(tf.int64, [1])
    self._huge = tf.reduce_sum(tf.fill(self._size, 1.0))
    self._steps = 0
  def before_run(self, run_context):
    self._steps += 1
    if self._steps == 3:
      return tf1.train.SessionRunArgs(self._huge,
                                      feed_dict={self._size: [2**40]})

real_train = train_lib.train
train_lib.train = lambda params, **kwargs: real_train(
    params, extra_hooks=[HugeFetchHook()], **kwargs)
app.run(train.main, flags_parser=cli.flags_parser("train"))
"""


# `//:train`'s main with one more hook, whose `end` blocks: the session
# never finishes closing (as a final save to a hung disk would not).
_BLOCKED_END_DRIVER = r"""
import time
from absl import app
import tensorflow as tf
from tf1_safe_train import cli, train
from tf1_safe_train.trainer.run import train_lib

class BlockedEndHook(tf.compat.v1.train.SessionRunHook):
  def end(self, session):
    time.sleep(3600)

real_train = train_lib.train
train_lib.train = lambda params, **kwargs: real_train(
    params, extra_hooks=[BlockedEndHook()], **kwargs)
app.run(train.main, flags_parser=cli.flags_parser("train"))
"""


# `//:train`'s main under an address-space limit of LIMIT bytes, its crash
# report's thread dump in DUMP_DIR (argv: `//:train`'s flags). A limit set
# here, after TensorFlow's import (done by the server it forks from), binds
# the run as one set before a fresh process's import would: the import's
# mappings stay under it either way.
_ADDRESS_SPACE_DRIVER = r"""
import resource
import tempfile
resource.setrlimit(resource.RLIMIT_AS, (%(limit)d, %(limit)d))
tempfile.tempdir = %(dump_dir)r
from absl import app
from tf1_safe_train import cli, train
app.run(train.main, flags_parser=cli.flags_parser("train"))
"""


class OutOfMemoryTest(tf.test.TestCase):

  # Regression test (issue 17, 4): --batch_size=100000 ended in a segfault
  # with a thread dump after TensorFlow's OOM. An out-of-memory step now
  # ends with one line naming it and exit code 1 (too costly to exhaust
  # 24 GB here: the error comes from a huge fetch in the same session).
  def testOutOfMemoryEndsWithOneLine(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    result = _server().run_code(
        _OOM_DRIVER, _common_args(train_dir) + ["--max_steps=100"])
    self.assertEqual(result.returncode, 1, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    self.assertNotIn("Fatal Python error", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr)
    self.assertEqual(binaries.our_lines(result.stderr)[-1], errors[0])
    self.assertStartsWith(errors[0], "train: error: out of memory "
                          "(ResourceExhaustedError: ")
    self.assertIn("OOM when allocating tensor with shape[1099511627776]",
                  errors[0])
    self.assertIn("--batch_size=4 on 2 tower(s); lower --batch_size",
                  errors[0])


  # The real thing, affordably: a 6 GB address-space limit makes the first
  # 5 GB activation of --batch_size=20000 fail to allocate (nothing large is
  # really allocated). TensorFlow's oneDNN convolution then crashes
  # (SIGSEGV); without oneDNN it raises ResourceExhaustedError. Either way:
  # one line naming the memory problem, exit code 1, no thread dump. The
  # run forks from the server (the limit is the driver's first line): what
  # is proven is main's handling of the failed allocation, not start-up.
  def testTooLargeBatchEndsWithOneLine(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    driver = _ADDRESS_SPACE_DRIVER % {"limit": 6 * 10**9,
                                      "dump_dir": self.get_temp_dir()}
    result = _server().run_code(driver, _common_args(train_dir) + [
        "--batch_size=20000", "--max_steps=3"])
    self.assertEqual(result.returncode, 1, result.stderr[-5000:])
    self.assertNotIn("Traceback", result.stderr)
    self.assertNotIn("Fatal Python error", result.stderr)
    errors = binaries.error_lines(result.stderr)
    self.assertLen(errors, 1, result.stderr[-5000:])
    self.assertEqual(binaries.our_lines(result.stderr)[-1], errors[0])
    self.assertStartsWith(errors[0], "train: error: ")
    self.assertIn("out of memory", errors[0])
    self.assertIn("--batch_size=20000 on 2 tower(s); lower --batch_size",
                  errors[0])


class SignalTest(tf.test.TestCase):

  def _interrupt(self, sig, train_dir=None, after=0):
    """Signals a trainer some steps past step `after`; checks the clean stop.

    Args:
      sig: the signal.
      train_dir: the run to resume, or None for a new one.
      after: the step the run resumes from.

    Returns:
      (train_dir, the step it stopped at, the run's log text).
    """
    train_dir = train_dir or tempfile.mkdtemp(dir=self.get_temp_dir())
    log = "%s-%d.log" % (train_dir, sig)
    drill = lib.Drill(_DRILL, 2, _SEED)
    # No replay of the skips (--max_explained_skips=0): the stop's claims
    # are the counters', the checkpoint's and the summary's.
    process = _server().start(_common_args(train_dir) + [
        "--max_steps=1000000", "--save_checkpoints_steps=1000000",
        "--log_every_n_steps=1", "--inject_nonfinite=" + drill.spec,
        "--max_consecutive_skips=0", "--max_explained_skips=0"], log)
    try:
      # Some steps in (and so past every start-up phase), then the signal.
      self.assertTrue(lib.wait_until(
          lambda: max(lib.progress_steps(lib.read_text(log)) or [0]) >=
          after + 8, 300, process=process), lib.read_text(log))
      lib.send(process, sig)
      process.wait(timeout=240)
    finally:
      if process.poll() is None:
        lib.kill_and_reap(process)
    text = lib.read_text(log)
    self.assertEqual(process.returncode, 0, text)
    self.assertNotIn("Traceback", text)
    self.assertEqual(binaries.error_lines(text), [])
    self.assertIn("signal %d: stopping after this step" % sig, text)

    summary = train_dirs.read_run_summary(train_dir)
    self.assertEqual(summary["exit_reason"], "interrupted")
    step = summary["global_step"]
    self.assertGreaterEqual(step, after + 8)
    self.assertEqual(summary["steps_this_run"], step - after)
    self.assertEqual(lib.summary_counters(summary),
                     drill.expected_counters(step))
    # The final checkpoint is at the summary's step (the interval is far).
    last = train_dirs.latest_checkpoint(train_dir)
    self.assertEqual(last, os.path.join(train_dir, "model.ckpt-%d" % step))
    values = train_dirs.checkpoint_values(last)
    self.assertEqual(train_dirs.nonfinite_entries(values), [])
    self.assertEqual(lib.checkpoint_counters(values),
                     drill.expected_counters(step))
    return train_dir, step, text

  # One run stopped twice: by SIGTERM, then, once resumed, by Ctrl-C
  # (SIGINT). Each stop is clean (exit 0, final checkpoint and summary at
  # its step, exact counters); the second run resumed from the first's
  # final checkpoint (its steps_this_run counts from there).
  def testSigtermThenCtrlCSaveCheckpointAndSummaryAndTheRunResumes(self):
    train_dir, step, _ = self._interrupt(signal.SIGTERM)
    _, _, text = self._interrupt(signal.SIGINT, train_dir, after=step)
    self.assertIn("Restoring parameters from %s" % os.path.join(
        train_dir, "model.ckpt-%d" % step), text)

  # Regression test (issue 17, 4): two SIGTERMs apart ended the run with
  # no line and no run_summary.json, and the final checkpoint half written.
  # The second signal now ends the run at once with one line and a summary,
  # and the last complete checkpoint stays the resume point. Regression
  # test (issue 23, 9): that summary lacked the rollback counters
  # (global_step 41 != applied 32 + skipped 4): it now has every field a
  # normal end's has.
  def testSecondSignalEndsAtOnceWithLineSummaryAndResumePoint(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    log = train_dir + ".log"
    # No replay of the skips (--max_explained_skips=0): the summary's
    # forensics fields are there all the same, its skip records counted.
    args = _common_args(train_dir) + [
        "--batch_size=2", "--max_steps=1000000", "--save_checkpoints_steps=5",
        "--log_every_n_steps=1", "--inject_nonfinite=nan@20-25:0",
        "--max_consecutive_skips=4", "--on_persistent_skips=rollback",
        "--rollback_min_applied_steps=5", "--max_explained_skips=0"]
    # The run blocks when its session ends (before its final checkpoint):
    # the second signal, however late, finds it still running.
    process = _server().start_code(_BLOCKED_END_DRIVER, args, log)
    try:
      self.assertTrue(lib.wait_until(
          lambda: max(lib.progress_steps(lib.read_text(log)) or [0]) >= 28,
          300, process=process), lib.read_text(log))
      lib.send(process, signal.SIGTERM)
      self.assertTrue(lib.wait_until(
          lambda: "stopping after this step" in lib.read_text(log), 120,
          process=process), lib.read_text(log))
      # Past the window in which further signals count as the first.
      time.sleep(2 * stop_signals.SAME_REQUEST_SECS)
      lib.send(process, signal.SIGTERM)
      process.wait(timeout=240)
    finally:
      if process.poll() is None:
        lib.kill_and_reap(process)
    text = lib.read_text(log)
    self.assertEqual(process.returncode, 128 + signal.SIGTERM, text)
    self.assertNotIn("Traceback", text)
    self.assertIn("rolled back at step", text)
    errors = binaries.error_lines(text)
    self.assertLen(errors, 1, text)
    self.assertEqual(binaries.our_lines(text)[-1], errors[0])
    self.assertStartsWith(errors[0], "train: error: second signal %d: "
                          "stopped at once" % signal.SIGTERM)
    summary = train_dirs.read_run_summary(train_dir)
    self.assertEqual(summary["exit_reason"], "aborted")
    self.assertGreaterEqual(summary["global_step"], 28)
    # Every field of a normal end's summary, the rollback's included.
    for key in ("applied_steps", "skipped_steps", "rolled_back_steps",
                "rollback_count", "rollbacks", "learning_rate_multiplier",
                "forensics", "nonfinite_steps_by_tower",
                "max_consecutive_skips_seen", "params"):
      self.assertIn(key, summary)
    self.assertEqual(summary["rollback_count"], 1)
    self.assertLen(summary["rollbacks"], 1)
    self.assertEqual(summary["global_step"], summary["applied_steps"] +
                     summary["skipped_steps"] + summary["rolled_back_steps"])
    self.assertEqual(summary["forensics"]["skip_records"],
                     summary["skipped_steps"])
    # The resume point is a complete checkpoint, named in line and summary.
    last = train_dirs.latest_checkpoint(train_dir)
    self.assertEqual(summary["resume_checkpoint"], last)
    self.assertIn(os.path.basename(last), errors[0])
    values = train_dirs.checkpoint_values(last)
    self.assertEqual(train_dirs.nonfinite_entries(values), [])
    step = int(values["global_step"])
    self.assertGreaterEqual(step, 25)
    # The rerun, in-process (the same flags as params): a resume is not the
    # binary's (testSigtermThenCtrlC... resumes the binary).
    rerun = train_lib.train(params_lib.TrainParams(
        train_dir=train_dir, num_towers=2, device="cpu", batch_size=2,
        save_summaries_steps=1000, seed=_SEED, max_steps=step + 2,
        save_checkpoints_steps=5, log_every_n_steps=1,
        inject_nonfinite="nan@20-25:0", max_consecutive_skips=4,
        on_persistent_skips="rollback", rollback_min_applied_steps=5,
        max_explained_skips=0).validate())
    self.assertEqual(rerun["exit_reason"], "max_steps")
    self.assertEqual(
        train_dirs.read_run_summary(train_dir)["steps_this_run"], 2)

  # Regression test (fixed in tf1_safe_train/train.py, main): the signal handlers are installed
  # only when train_lib.train starts its session, so Ctrl-C during start-up
  # (TensorFlow's import, graph building: 5-10 s) ends with a KeyboardInterrupt
  # traceback. Nothing is trained yet, so a non-zero exit is right, but with
  # one line. Fix: catch KeyboardInterrupt in main and cli.fail(...,
  # "interrupted before training started", 130).
  def testCtrlCDuringStartUpExitsWithOneLine(self):
    process, text = self._signal_during_start_up(signal.SIGINT)
    self.assertNotEqual(process.returncode, 0)
    self.assertLen(binaries.error_lines(text), 1, text)

  # Regression test (issue 23, 9): SIGTERM during start-up ended the run
  # with exit code 143 and no line at all. It now says so in one line (and
  # still exits 128 + 15).
  def testSigtermDuringStartUpExitsWithOneLine(self):
    process, text = self._signal_during_start_up(signal.SIGTERM)
    self.assertEqual(process.returncode, 128 + signal.SIGTERM, text)
    errors = binaries.error_lines(text)
    self.assertEqual(errors, ["train: error: signal 15 (SIGTERM) before "
                              "training started: stopped, nothing trained"],
                     text)

  def _signal_during_start_up(self, signum):
    """(process, log text) of a trainer sent `signum` while starting."""
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    log = train_dir + ".log"
    process = lib.start_trainer(_common_args(train_dir), log)
    try:
      # Once main() handles SIGTERM (Python handles SIGINT from its own
      # start-up, which a fixed sleep could hit under load: a
      # KeyboardInterrupt traceback from absl's import). TensorFlow's import
      # and the graph take seconds more.
      self.assertTrue(lib.wait_until(
          lambda: _catches(process.pid, signal.SIGTERM), 120,
          interval=0.01, process=process), lib.read_text(log))
      lib.send(process, signum)
      process.wait(timeout=240)
    finally:
      if process.poll() is None:
        lib.kill_and_reap(process)
    text = lib.read_text(log)
    self.assertFalse(lib.progress_steps(text))  # It was still starting.
    self.assertNotIn("Traceback", text)
    return process, text


def _catches(pid, signum):
  """True if process `pid` has a handler for `signum` (/proc: SigCgt)."""
  try:
    with open("/proc/%d/status" % pid) as f:
      for line in f:
        if line.startswith("SigCgt:"):
          return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
  except (OSError, ValueError):
    pass
  return False


if __name__ == "__main__":
  tf.test.main()
