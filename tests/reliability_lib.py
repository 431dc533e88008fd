"""The trainer as a process, and what it leaves in its --train_dir.

Shared by the reliability tests: start `//:train` as a user would (through
`binaries`: the Bazel-built binary under `bazel test`, else `python -m`),
signal it, and read the checkpoints and the run summary it writes. Checks are
exact: the pure-Python twin of the fault drill
(`injection.expected_injections`) says which steps must have been skipped.
"""

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import tensorflow as tf

import binaries
from tf1_safe_train import injection

tf1 = tf.compat.v1

RUN_SUMMARY = "run_summary.json"  # run_summary.RUN_SUMMARY, without importing TF.

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
                            env=binaries.env(), start_new_session=True)


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


# The trainer's output read as every test of a binary reads it.
our_lines = binaries.our_lines
error_lines = binaries.error_lines


def progress_steps(text):
  """The steps of the trainer's progress lines ('step N  loss ...') in `text`."""
  return [int(m.group(1)) for m in re.finditer(r"\bstep (\d+)  loss ", text)]


def read_run_summary(train_dir):
  with open(os.path.join(train_dir, RUN_SUMMARY)) as f:
    return json.load(f)


def checkpoint_paths(train_dir):
  """The complete checkpoints the `checkpoint` state file lists, oldest first."""
  state = tf1.train.get_checkpoint_state(train_dir)
  if state is None:
    return []
  return [p if os.path.isabs(p) else os.path.join(train_dir, p)
          for p in state.all_model_checkpoint_paths]


def latest_checkpoint(train_dir):
  return tf1.train.latest_checkpoint(train_dir)


def checkpoint_values(path):
  """Every entry of the checkpoint at `path`, as numpy values."""
  reader = tf1.train.load_checkpoint(path)
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}


def nonfinite_entries(values):
  """Names of the floating entries of `values` holding a NaN or an Inf."""
  bad = []
  for name, value in sorted(values.items()):
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
      bad.append(name)
  return bad


def model_state(values):
  """`values` without `SKIP_BOOKKEEPING`: what a skipped step must not move."""
  return {n: v for n, v in values.items() if n not in SKIP_BOOKKEEPING}


def files_snapshot(directory):
  """{relative path: bytes} of every file under `directory`."""
  snapshot = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        snapshot[os.path.relpath(path, directory)] = f.read()
  return snapshot


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
