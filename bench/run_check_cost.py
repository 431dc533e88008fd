"""What the first-run check (`core/run_check`) costs a good step, in Python.

The check adds no op to a step (tests/core/run_check_test.py counts executed
nodes); what it adds is Python work in every `session.run`: a key built
from the fetches and feeds, one dict lookup. Measured on a tiny guarded
step (a 3-vector and a scalar, an EMA protected), whose run is little but
Python and the executor's fixed cost, so the check's share is as large as
it can get: `session.run` unpatched (TensorFlow's own), on a graph whose
wrapper was built with `check_runs=False` (one attribute lookup) and with
the check (the default), interleaved block by block (`timing.round_robin`).
`guard_overhead` prints the result as its own row.
"""

import collections
import statistics

import numpy as np
import tensorflow as tf

from bench import timing
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train.core import run_check

tf1 = tf.compat.v1

# name -> label, in the rows' order. The first two time the check's own
# work alone (a loop of what the patched run adds), which a session.run's
# noise would hide; the last two are whole runs, for scale.
LABELS = collections.OrderedDict([
    ("check_watched", "check's work per run, timed alone (default)"),
    ("check_unwatched", "check's work per run, timed alone "
                        "(check_runs=False, the trainer's)"),
    ("run_unpatched", "whole session.run, TensorFlow's own"),
    ("run_checked", "whole session.run, checked"),
])
_CALLS_PER_RUN_BLOCK = 10  # Calls of the check's work per timed "run".


def _build(check_runs):
  """A tiny guarded step in its own graph: (session, fetches, feed_dict)."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf1.placeholder(tf.float32, [3])
    w = tf1.get_variable("w", initializer=tf.constant([0.25, -0.5, 1.0]))
    loss = tf.reduce_sum(tf.square(w * x - 1.0))
    global_step = tf1.train.get_or_create_global_step()
    opt = optimizer_lib.SkipNonFiniteOptimizer(
        tf1.train.GradientDescentOptimizer(0.01), check_runs=check_runs)
    apply_op = opt.minimize(loss, global_step=global_step)
    ema = tf1.train.ExponentialMovingAverage(0.9)
    train_op = opt.protect(tf.group(apply_op, ema.apply([w])))
    init = tf1.global_variables_initializer()
  graph.finalize()
  session = tf1.Session(graph=graph)
  session.run(init)
  # A loop's usual fetches: the train op, the loss and the step.
  fetches = {"train": train_op, "values": [loss, global_step]}
  return session, fetches, {x: np.ones([3], np.float32)}


def measure(rounds, runs_per_block, warmup_runs=20):
  """Python time per `session.run` of a tiny step, with and without check.

  Args:
    rounds: round-robin rounds.
    runs_per_block: runs per timed block.
    warmup_runs: untimed runs of each variant first (the checked one's
      first run walks the graph once).

  Returns:
    A dict: `us_per_run` (name -> median microseconds per run, names as
    `LABELS`), `labels`, `rounds`, `runs_per_block`.
  """
  original_run = run_check.original_run()
  unwatched, _, _ = _build(False)
  session, fetches, feed = _build(True)
  check = run_check.graph_check(session.graph)

  def watched_work():
    for _ in range(_CALLS_PER_RUN_BLOCK):
      check.before_run(session.graph, fetches, feed)

  def unwatched_work():
    for _ in range(_CALLS_PER_RUN_BLOCK):
      run_check.graph_check(unwatched.graph)

  steps = collections.OrderedDict([
      ("check_watched", watched_work),
      ("check_unwatched", unwatched_work),
      ("run_unpatched", lambda: original_run(session, fetches, feed)),
      ("run_checked", lambda: session.run(fetches, feed)),
  ])
  try:
    times = timing.round_robin(steps, rounds, runs_per_block, warmup_runs)
  finally:
    session.close()
    unwatched.close()
  calls = {"check_watched": _CALLS_PER_RUN_BLOCK,
           "check_unwatched": _CALLS_PER_RUN_BLOCK}
  us = {n: statistics.median(t.wall) / runs_per_block / calls.get(n, 1) * 1e6
        for n, t in times.items()}
  return {
      "us_per_run": {n: round(v, 3) for n, v in us.items()},
      "labels": dict(LABELS),
      "rounds": len(times["run_checked"].wall),
      "runs_per_block": runs_per_block,
  }


def markdown(result):
  """The result as one table row per measurement, and what it means."""
  rows = [["first-run check", result["labels"][n],
           "%.2f" % result["us_per_run"][n]] for n in LABELS]
  table = timing.markdown_table(
      ["row", "what (a tiny guarded step)", "µs per session.run (median)"],
      rows)
  return table + (
      "\n\n- First-run check (`run_check`): the Python work the patched "
      "session.run adds to every run of a checked graph (a key from the "
      "fetches {train op, [loss, global_step]} and one feed, one dict "
      "lookup) and of an unwatched one (one attribute lookup), timed alone "
      "in loops; then whole runs of that 3-vector step, whose differences "
      "are within the noise. %d rounds of %d runs, interleaved. The check "
      "adds no executed node (tests/core/run_check_test.py)." % (
          result["rounds"], result["runs_per_block"]))
