"""SIGTERM and Ctrl-C: a clean stop, then a bounded end whatever blocks.

The first signal stops the run after the current step: the session closes,
the final checkpoint and `run_summary.json` are written. A second signal ends
the process at once, without waiting for that checkpoint: one line, a run
summary of the last finished step, and the last *complete* checkpoint stays
the resume point (TensorFlow writes checkpoint files under temporary names
and replaces the `checkpoint` file atomically, so an interrupted save never
becomes the resume point).

Python runs signal handlers in the main thread only, between bytecodes: while
`session.run` blocks (a step waiting on a dead parameter server, a final save)
they would not run at all. So the handlers here do nothing themselves;
`signal.set_wakeup_fd` makes the C-level handler write each signal's number
into a pipe, which a watchdog thread reads at once. The same thread runs an
optional liveness check (a cluster worker's parameter servers) and ends the
process when it fails, and, after a first signal, ends it when the run has
not stopped within `stop_grace_secs`.

One request often arrives as several signals: `timeout` signals its child and
then the child's process group (two SIGTERMs), a terminal's Ctrl-C reaches
the whole foreground group, and the kernel sends a task's parent-death signal
once per thread of the dying launcher it is handed to. A handler cannot see
who sent a signal, so signals arriving within `SAME_REQUEST_SECS` of the
first count as that one; only a signal after that window is a second one.
"""

import os
import select
import signal
import sys
import threading
import time

from absl import logging
import tensorflow as tf

from tf1_safe_train.trainer.run import run_summary

tf1 = tf.compat.v1

_POLL_SECS = 1.0
# Signals this soon after the first are the same request (module doc): long
# enough for every copy of one request, short enough that a user's second
# Ctrl-C ("stop now") is never swallowed.
SAME_REQUEST_SECS = 1.0


def _already_stopped(signum, frame):
  del frame  # Unused.
  logging.warning("signal %d: the run has already stopped (final checkpoint "
                  "written); exiting", signum)


def write_abort_summary(train_dir, summary, reason):
  """Writes the run summary of a run ended without its final checkpoint.

  Args:
    train_dir: the run's directory.
    summary: `run_summary.build(...)` of the last finished step, with
      exit_reason "aborted".
    reason: why the run ended (the error line's text).

  Returns:
    The text the error line ends with: where a rerun resumes.
  """
  resume = tf1.train.latest_checkpoint(train_dir)
  run_summary.write(train_dir, dict(summary, abort_reason=reason,
                                          resume_checkpoint=resume))
  return "; %s written; a rerun resumes from %s" % (
      run_summary.RUN_SUMMARY,
      os.path.basename(resume) if resume else "step 0 (no checkpoint yet)")


class StopOnSignalHook(tf1.train.SessionRunHook):
  """Turns SIGTERM and Ctrl-C into a clean stop, a second one into an end.

  Install with `install()` from the main thread (before the session is
  created) and remove with `uninstall()`.
  """

  def __init__(self, program="train", signals=(signal.SIGTERM, signal.SIGINT),
               on_abort=None, liveness=None, stop_grace_secs=None,
               poll_secs=_POLL_SECS, same_request_secs=SAME_REQUEST_SECS):
    """Creates the hook.

    Args:
      program: the binary's name, for the one error line.
      signals: the signals that stop the run.
      on_abort: optional `on_abort(reason)` called (from the watchdog
        thread) just before the process ends without its final checkpoint;
        returns an optional text appended to the error line (e.g. the resume
        point). It must not raise; if it does, the line says so.
      liveness: optional `liveness(interrupted)` called every `poll_secs`
        from the watchdog thread; returns None while all is well, or a
        message to end the process with (exit code 1). `interrupted` tells
        it that a signal asked the run to stop.
      stop_grace_secs: after a first signal, end the process if the run has
        not stopped within this many seconds (None: wait as long as it
        takes).
      poll_secs: how often the watchdog runs `liveness` and the grace check.
      same_request_secs: signals within this many seconds of the first
        count as the first (see the module doc).
    """
    self._program = program
    self._signals = signals
    self._on_abort = on_abort
    self._liveness = liveness
    self._stop_grace_secs = stop_grace_secs
    self._poll_secs = poll_secs
    self._same_request_secs = same_request_secs
    self._previous = {}
    self._previous_wakeup_fd = -1
    self._pipe = None
    self._thread = None
    self._done = threading.Event()
    self._interrupted_at = None
    self.interrupted = False

  def install(self):
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # The C handler must never block.
    self._pipe = (read_fd, write_fd)
    self._previous_wakeup_fd = signal.set_wakeup_fd(
        write_fd, warn_on_full_buffer=False)
    for sig in self._signals:
      # A Python-level handler is needed for the wakeup fd to be written;
      # the work is the watchdog's.
      self._previous[sig] = signal.signal(sig, lambda s, f: None)
    self._done.clear()
    self._thread = threading.Thread(target=self._watch, name="stop_signals",
                                    daemon=True)
    self._thread.start()

  def uninstall(self):
    """Stops the watchdog; restores the previous handlers.

    After a signal the run is over but the process is still ending (summary,
    exit): a further signal then only logs, rather than killing a process
    that has saved everything without the line that says so. A previous
    handler marked `start_up_only` (the binaries' "before training started",
    `cli.raise_on_sigterm_during_start_up`) is not restored: the default is.
    """
    for sig, handler in self._previous.items():
      if getattr(handler, "start_up_only", False):
        handler = signal.SIG_DFL
      signal.signal(sig, _already_stopped if self.interrupted else handler)
    self._previous = {}
    if self._pipe is None:
      return
    signal.set_wakeup_fd(self._previous_wakeup_fd)
    self._done.set()
    # Wakes the watchdog out of its select: otherwise every run's end waits
    # for the rest of a poll (up to `poll_secs`). Byte 0 is no signal; a full
    # pipe is readable already.
    try:
      os.write(self._pipe[1], b"\0")
    except BlockingIOError:
      pass
    self._thread.join()
    for fd in self._pipe:
      os.close(fd)
    self._pipe = None

  def stop_liveness(self):
    """No more liveness checks (e.g. the parameter servers may now exit)."""
    self._liveness = None

  def after_run(self, run_context, run_values):
    if self.interrupted:
      run_context.request_stop()

  def _watch(self):
    read_fd = self._pipe[0]
    while not self._done.is_set():
      ready, _, _ = select.select([read_fd], [], [], self._poll_secs)
      if self._done.is_set():
        return
      if ready:
        now = time.monotonic()
        for signum in os.read(read_fd, 64):
          if signum in self._signals:
            self._on_signal(signum, now)
      self._check()

  def _on_signal(self, signum, now):
    """Handles signal `signum`, read at time.monotonic() `now`."""
    if not self.interrupted:
      logging.warning("signal %d: stopping after this step (a second signal "
                      "%gs or more later stops at once, without the final "
                      "checkpoint)", signum, self._same_request_secs)
      self._interrupted_at = now
      self.interrupted = True
      return
    if now - self._interrupted_at < self._same_request_secs:
      logging.info("signal %d %.3fs after the first: the same request "
                   "(still stopping after this step)", signum,
                   now - self._interrupted_at)
      return
    self._abort("second signal %d: stopped at once, without the final "
                "checkpoint" % signum, 128 + signum)

  def _check(self):
    liveness = self._liveness
    if liveness is not None:
      problem = liveness(self.interrupted)
      if problem:
        self._abort(problem, 1)
    if (self._interrupted_at is not None and
        self._stop_grace_secs is not None and
        time.monotonic() - self._interrupted_at > self._stop_grace_secs):
      self._abort("the run did not stop within %gs of the signal; stopped "
                  "without the final checkpoint" % self._stop_grace_secs, 1)

  def _abort(self, reason, exit_code):
    """Ends the process from the watchdog thread, with one line."""
    if self._done.is_set():
      return  # The run finished meanwhile.
    suffix = ""
    if self._on_abort is not None:
      try:
        suffix = self._on_abort(reason) or ""
      except Exception as e:  # pylint: disable=broad-except
        suffix = " (could not write the run summary: %s)" % e
    message = " ".join((reason + suffix).split())
    try:
      for handler in logging.get_absl_logger().handlers:
        handler.flush()
      sys.stdout.flush()
      sys.stderr.write("%s: error: %s\n" % (self._program, message))
      sys.stderr.flush()
    finally:
      # Not sys.exit: the main thread may be blocked in TensorFlow for good,
      # and interpreter teardown with TensorFlow's threads running can crash.
      os._exit(exit_code)  # pylint: disable=protected-access
