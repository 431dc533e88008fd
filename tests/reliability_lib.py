"""The trainer as a process, and what a fault drill must leave behind.

Shared by the reliability tests: start `//:train` as a user would (through
`binaries`: the Bazel-built binary under `bazel test`, else `python -m`),
signal it, and compare what it writes (read with `train_dir_util`) with exact
expectations: the pure-Python twin of the fault drill
(`injection.expected_injections`) says which steps must have been skipped.
"""

import os
import re
import signal
import subprocess
import time

import numpy as np

import binaries
from tf1_safe_train.trainer import injection

# Checkpoint entries that a skipped step changes (or may change): the step and
# skip counters and the drill's own statistics. Every other entry (weights,
# optimizer slots, moving statistics, EMA shadows, applied_steps) must be
# bit-identical across a skipped step.
SKIP_BOOKKEEPING = frozenset([
    "global_step", "skipped_steps", "consecutive_skips",
    "nonfinite_steps_by_tower", "max_consecutive_skips_seen",
])


def run_trainer(args, timeout=600):
  """Runs the trainer to its end; returns the `CompletedProcess` (text)."""
  return binaries.run("train", *args, timeout=timeout)


def start_trainer(args, log_path):
  """Starts the trainer in its own process group, output to `log_path`.

  Args:
    args: the flags.
    log_path: file receiving stdout and stderr (appended to).

  Returns:
    The `subprocess.Popen`; its pid is also its process group id.
  """
  with open(log_path, "ab") as log:
    return subprocess.Popen(binaries.command("train") + list(args),
                            stdout=log, stderr=subprocess.STDOUT,
                            env=binaries.env(), start_new_session=True,
                            preexec_fn=_default_sigint)


def _default_sigint():
  # A shell starts a background job with SIGINT ignored, and an ignored
  # signal stays ignored across exec: the trainer would never see the
  # tests' Ctrl-C (as a terminal's Ctrl-C reaches a foreground run).
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def send(process, sig):
  """Sends `sig` to the process group the test started (like a terminal)."""
  try:
    os.killpg(process.pid, sig)
  except ProcessLookupError:
    pass


def kill_and_reap(process):
  """SIGKILLs the process group of `process` and waits for the process."""
  send(process, signal.SIGKILL)
  process.wait(timeout=60)


def wait_until(predicate, timeout, interval=0.05, process=None):
  """Polls `predicate()` until true; False on timeout or if `process` exits."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return True
    if process is not None and process.poll() is not None:
      return bool(predicate())
    time.sleep(interval)
  return False


def read_text(path):
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except FileNotFoundError:
    return ""


def progress_steps(text):
  """The steps of the progress lines ('step N/M  loss ...') in `text`."""
  return [int(m.group(1))
          for m in re.finditer(r"\bstep (\d+)(?:/\d+)?  loss ", text)]


def model_state(values):
  """`values` without `SKIP_BOOKKEEPING`: what a skipped step must not move."""
  return {n: v for n, v in values.items() if n not in SKIP_BOOKKEEPING}


class Drill(object):
  """A --inject_nonfinite spec and its exact expectations.

  A step is skipped when any tower is poisoned (the drill's inject_into does
  not matter: every kind poisons grads, loss and input alike, see
  reliability_soak_test).
  """

  def __init__(self, spec, num_towers, seed):
    self.spec = spec
    self.rules = injection.parse_spec(spec)
    self.num_towers = num_towers
    self.seed = seed

  def poisoned(self, start, stop):
    """(per-tower counts, set of poisoned steps) over steps [start, stop)."""
    return injection.expected_injections(
        self.rules, stop - start, self.num_towers, seed=self.seed,
        start_step=start)

  def kind(self, step, tower):
    """The kind (nan, inf, -inf) poisoning `tower` at `step`, or None."""
    active, value = injection.is_active(self.rules, step, tower,
                                        seed=self.seed)
    if not active:
      return None
    return "nan" if np.isnan(value) else ("inf" if value > 0 else "-inf")

  def expected_counters(self, global_step):
    """The skip counters a checkpoint at `global_step` must hold."""
    counts, steps = self.poisoned(0, global_step)
    consecutive = 0
    while global_step - 1 - consecutive in steps:
      consecutive += 1
    return {
        "global_step": global_step,
        "applied_steps": global_step - len(steps),
        "skipped_steps": len(steps),
        "consecutive_skips": consecutive,
        "nonfinite_steps_by_tower": counts,
        "max_consecutive_skips_seen": longest_run(steps),
    }


def longest_run(steps):
  """The length of the longest run of consecutive integers in `steps`."""
  steps, best = set(steps), 0
  for s in steps:
    if s - 1 not in steps:
      n = 1
      while s + n in steps:
        n += 1
      best = max(best, n)
  return best


def checkpoint_counters(values):
  """The skip counters held in checkpoint `values`, as Python ints."""
  return {
      "global_step": int(values["global_step"]),
      "applied_steps": int(values["applied_steps"]),
      "skipped_steps": int(values["skipped_steps"]),
      "consecutive_skips": int(values["consecutive_skips"]),
      "nonfinite_steps_by_tower": [
          int(c) for c in values["nonfinite_steps_by_tower"]],
      "max_consecutive_skips_seen": int(values["max_consecutive_skips_seen"]),
  }


def summary_counters(summary):
  """The same counters from a run_summary.json dict."""
  return {k: summary[k] for k in (
      "global_step", "applied_steps", "skipped_steps", "consecutive_skips",
      "nonfinite_steps_by_tower", "max_consecutive_skips_seen")}
