"""Soak: a long two-tower run under random NaN/Inf faults never gets hurt.

About 5% of the steps are poisoned at random (nan, inf and -inf, on both
towers). The run is three segments resuming the same --train_dir, one per
--inject_into target (grads, then loss, then input), so one run sees faults
in all three places. A clean run with the same seed and segments is the
reference. Checked exactly: the skipped steps are the injected steps (counts,
per-tower counts, longest streak, the log's step numbers); every checkpoint
written during the run is finite and holds the exact counters of its step;
the final held-out loss is within 10% of the clean run's. The learning rate
follows a cosine schedule (over each segment, on applied steps), so both runs
end at a learning rate near zero and their final losses say where training
got, not where the last noisy step happened to land (with a constant rate,
a 300-step run differed from the clean one by 11%).

Every kind poisons every target: nan anywhere propagates; +-inf times the
loss (`inject_into=loss` multiplies) gives +-inf or, times a zero gradient
entry, NaN; +-inf input images reach conv1's weight gradient as inf times the
upstream gradient, which is +-inf or NaN (inf * 0) whatever that gradient is.
So a step is skipped exactly when some tower is poisoned, and the count is
`injection.expected_injections`; `testEveryKindPoisonsEveryTarget` checks it.

Steps: $TF1_SAFE_TRAIN_SOAK_STEPS (default 150; the `long` Bazel target runs
2000).
"""

import logging as std_logging
import os
import tempfile

from absl import logging
import tensorflow as tf

from tests.fixtures import reliability as lib
from tests.fixtures import train_dirs
from tf1_safe_train.trainer.run import eval_lib
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

STEPS_ENV = "TF1_SAFE_TRAIN_SOAK_STEPS"
_DEFAULT_STEPS = 150
# About 5% of the steps: tower 0 ~3% (nan, -inf), tower 1 2% (inf).
_SPEC = "nan%0.02:0,-inf%0.01:0,inf%0.02:1"
# With this seed every segment poisons both towers, at 150, 300 and 2000
# steps.
_SEED = 7
_NUM_TOWERS = 2
_BATCH_SIZE = 8
_CHECKPOINT_EVERY = 25
_TARGETS = ("grads", "loss", "input")
_LOSS_TOLERANCE = 0.10


def soak_steps():
  text = os.environ.get(STEPS_ENV, "").strip()
  steps = int(text) if text else _DEFAULT_STEPS
  if steps < len(_TARGETS) * _CHECKPOINT_EVERY:
    raise ValueError("%s=%d: need at least %d steps" %
                     (STEPS_ENV, steps, len(_TARGETS) * _CHECKPOINT_EVERY))
  return steps


def segment_ends(steps):
  """Where each segment stops: thirds, rounded down to a checkpoint."""
  every = _CHECKPOINT_EVERY
  return [steps * k // 3 // every * every for k in (1, 2)] + [steps]


def _params(train_dir, max_steps, inject_into, inject_nonfinite,
            checkpoint_every):
  return params_lib.TrainParams(
      train_dir=train_dir, model="small_cnn", dataset="synthetic",
      num_towers=_NUM_TOWERS, device="cpu", batch_size=_BATCH_SIZE,
      max_steps=max_steps, lr_schedule="cosine", max_consecutive_skips=50,
      save_checkpoints_steps=checkpoint_every, save_summaries_steps=100,
      log_every_n_steps=100, inject_nonfinite=inject_nonfinite,
      inject_into=inject_into, seed=_SEED).validate()


class CheckpointScanHook(tf1.train.SessionRunHook):
  """Scans every checkpoint as soon as the `checkpoint` state lists it.

  The saver keeps the last 5; checking the state after every step (the saver
  writes in the same thread, between steps) sees each one before it is
  rotated out.
  """

  def __init__(self, train_dir, scanned):
    self._train_dir = train_dir
    self._scanned = scanned  # {(path, index mtime): checkpoint values info}

  def scan(self):
    for path in train_dirs.checkpoint_paths(self._train_dir):
      key = (path, os.stat(path + ".index").st_mtime_ns)
      if key not in self._scanned:
        values = train_dirs.checkpoint_values(path)
        self._scanned[key] = (train_dirs.nonfinite_entries(values),
                              lib.checkpoint_counters(values))

  def after_run(self, run_context, run_values):
    self.scan()

  def end(self, session):
    self.scan()


class _Records(std_logging.Handler):

  def __init__(self):
    super().__init__(std_logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _soak(train_dir, spec, steps, scan=True):
  """Runs the segments; returns (summaries, scanned checkpoints, warnings).

  Without `scan` (the clean reference, whose checkpoints no test reads) a
  segment checkpoints only at its end, where the next one resumes: saving
  changes no number the run computes.
  """
  scanned, summaries = {}, []
  records = _Records()
  logger = logging.get_absl_logger()
  logger.addHandler(records)
  try:
    for target, end in zip(_TARGETS, segment_ends(steps)):
      hooks = [CheckpointScanHook(train_dir, scanned)] if scan else []
      summaries.append(train_lib.train(
          _params(train_dir, end, target, spec,
                  _CHECKPOINT_EVERY if scan else end), extra_hooks=hooks))
      for hook in hooks:
        hook.scan()  # The final checkpoint is written after the hooks end.
  finally:
    logger.removeHandler(records)
  return summaries, scanned, records.messages


def _held_out_loss(train_dir):
  return eval_lib.evaluate(params_lib.EvalParams(
      train_dir=train_dir, model="small_cnn", dataset="synthetic",
      batch_size=200, max_examples=2000))["loss"]


class SoakTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.steps = soak_steps()
    cls.drill = lib.Drill(_SPEC, _NUM_TOWERS, _SEED)
    root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    cls.faulty_dir = os.path.join(root, "faulty")
    cls.clean_dir = os.path.join(root, "clean")
    cls.summaries, cls.scanned, cls.warnings = _soak(
        cls.faulty_dir, _SPEC, cls.steps)
    cls.clean_summaries, _, _ = _soak(cls.clean_dir, "", cls.steps,
                                      scan=False)

  def testDrillCoversBothTowersEveryTargetAndEveryKind(self):
    # A precondition of the other tests, not a property of the trainer.
    starts = [0] + segment_ends(self.steps)[:-1]
    kinds = set()
    for target, start, end in zip(_TARGETS, starts, segment_ends(self.steps)):
      counts, steps = self.drill.poisoned(start, end)
      self.assertTrue(all(counts), "%s: %s" % (target, counts))
      kinds |= {self.drill.kind(s, t) for s in steps for t in (0, 1)}
    self.assertEqual(kinds - {None}, {"nan", "inf", "-inf"})
    _, steps = self.drill.poisoned(0, self.steps)
    self.assertBetween(len(steps) / self.steps, 0.03, 0.08)

  def testSkippedStepsAreExactlyTheInjectedSteps(self):
    for summary, end in zip(self.summaries, segment_ends(self.steps)):
      self.assertEqual(summary["exit_reason"], "max_steps")
      self.assertEqual(lib.summary_counters(summary),
                       self.drill.expected_counters(end))
    final = self.summaries[-1]
    self.assertEqual(final["global_step"], self.steps)
    self.assertEqual(final["skipped_steps"],
                     len(self.drill.poisoned(0, self.steps)[1]))
    self.assertEqual(final["applied_steps"] + final["skipped_steps"],
                     self.steps)

  def testEverySkipIsReportedWithItsStep(self):
    reported = sorted(int(m.split()[2].rstrip(":")) for m in self.warnings
                      if m.startswith("skipped step "))
    self.assertEqual(reported, sorted(self.drill.poisoned(0, self.steps)[1]))

  def testEveryCheckpointIsFiniteWithExactCounters(self):
    seen = set()
    for (path, _), (nonfinite, counters) in sorted(self.scanned.items()):
      self.assertEqual(nonfinite, [], path)
      self.assertEqual(counters,
                       self.drill.expected_counters(counters["global_step"]),
                       path)
      seen.add(counters["global_step"])
    # Every checkpoint the run wrote was scanned: each multiple of the
    # checkpoint interval, and each segment's end.
    expected = set(range(0, self.steps + 1, _CHECKPOINT_EVERY))
    expected |= set(segment_ends(self.steps))
    self.assertEqual(seen, expected)

  def testFinalLossWithinTenPercentOfCleanRun(self):
    clean_final = self.clean_summaries[-1]
    self.assertEqual(clean_final["skipped_steps"], 0)
    self.assertEqual(clean_final["global_step"], self.steps)
    faulty, clean = (_held_out_loss(self.faulty_dir),
                     _held_out_loss(self.clean_dir))
    logging.info("held-out loss after %d steps: faulty %.4f, clean %.4f",
                 self.steps, faulty, clean)
    # The comparison means something only if the clean run learned.
    self.assertLess(clean, 0.8 * 2.302585)  # ln(10): chance level.
    self.assertLessEqual(abs(faulty - clean), _LOSS_TOLERANCE * clean,
                         "faulty %.4f vs clean %.4f" % (faulty, clean))


class EveryKindPoisonsEveryTargetTest(tf.test.TestCase):

  def testEveryKindPoisonsEveryTarget(self):
    # Each kind on two steps, on both towers: every one of those steps must
    # be skipped and counted on its tower, whatever the target (so the soak
    # may count every injection as a skip). The claim is the step's (the
    # soak's runs build the same one): it runs in a plain session, without
    # the runner's hooks, checkpoints and forensics, which cost each of
    # these short runs more than its steps.
    spec = "nan@1-2:1,inf@3-4:1,-inf@5-6:0,inf@7:0"
    for target in _TARGETS:
      with self.subTest(target=target):
        totals = _step_totals(params_lib.TrainParams(
            train_dir=self.get_temp_dir(), num_towers=2, device="cpu",
            batch_size=4, inject_nonfinite=spec, inject_into=target,
            seed=_SEED).validate(), steps=9)
        self.assertEqual(totals["global_step"], 9)
        self.assertEqual(list(totals["nonfinite_steps_by_tower"]), [3, 4])
        self.assertEqual(totals["counters"].skipped_steps, 7)
        self.assertEqual(totals["counters"].applied_steps, 2)


def _step_totals(params, steps):
  """The trainer's step for `params`, run `steps` times in a plain session:
  its totals (counters) after the last."""
  with tf.Graph().as_default():
    tf1.set_random_seed(params.seed)
    strategy = local_replication.Local(params)
    with strategy.device():
      step = train_step.build_step(params, strategy)
    with tf1.train.SingularMonitoredSession(
        config=towers.session_config(strategy.tower_config)) as session:
      for _ in range(steps):
        totals = session.run(step.totals)  # Runs the step, then reads.
  return totals


if __name__ == "__main__":
  tf.test.main()
