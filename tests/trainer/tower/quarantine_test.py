"""--quarantine_after=K: a tower whose faults never reproduce is left out.

Through //:train (the quarantine), then in process on copies of that run:
a restart that keeps it (and what its steps execute without the tower),
and a clear whose input faults never count.
"""

import json
import os
import shutil
import signal
import tempfile

import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import forensics_params
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.tower import quarantine
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1

# Tower 2's gradients poisoned on three steps (a grads drill never
# reproduces on replay: a suspect device each time). Three towers, the
# fewest that quarantine one (never below 2 towers left).
_DRILL = "nan@2:2,nan@4:2,nan@6:2"
_FLAGS = ("--num_towers=3", "--device=cpu", "--batch_size=2",
          "--skip_unit=tower", "--quarantine_after=2",
          "--save_checkpoints_steps=100", "--log_every_n_steps=100")
_QUARANTINED = ("quarantined towers (--quarantine_after=2, kept from the "
                "checkpoint; --clear_quarantine starts over): 2 "
                "(/device:CPU:2)")


def _params(train_dir, **overrides):
  values = dict(num_towers=3, batch_size=2, max_steps=8, skip_unit="tower",
                quarantine_after=2, inject_nonfinite=_DRILL)
  values.update(overrides)
  return forensics_params.params(train_dir, **values)


def _suspect_faults(train_dir):
  """Each tower's count of faults that did not reproduce, as checkpointed."""
  reader = tf1.train.load_checkpoint(tf1.train.latest_checkpoint(train_dir))
  return reader.get_tensor(quarantine.FAULTS).tolist()


def _summary(train_dir):
  with open(os.path.join(train_dir, "run_summary.json")) as f:
    return json.load(f)


class _TraceOneStep(tf1.train.SessionRunHook):
  """The `RunMetadata` of a session's second step, traced in full (the
  first may run one-time work)."""

  def __init__(self):
    self.metadata = None
    self._runs = 0

  def before_run(self, run_context):
    self._runs += 1
    if self._runs == 2:
      return tf1.train.SessionRunArgs(None, options=tf1.RunOptions(
          trace_level=tf1.RunOptions.FULL_TRACE))
    return None

  def after_run(self, run_context, run_values):
    if self._runs == 2:
      self.metadata = run_values.run_metadata


class QuarantineTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One binary run whose train_dir the restarts below start from (copies).
    cls.root = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())
    cls.quarantined_dir = os.path.join(cls.root, "quarantined")
    cls.first = binaries.run("train", "--train_dir=" + cls.quarantined_dir,
                             "--max_steps=8", "--inject_nonfinite=" + _DRILL,
                             *_FLAGS, timeout=600)

  def _copy_of_the_quarantined_run(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    os.rmdir(train_dir)
    shutil.copytree(self.quarantined_dir, train_dir, symlinks=True)
    return train_dir

  def testQuarantinedAfterTwoSuspectFaults(self):
    result = self.first
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("tower 2 (/device:CPU:2) quarantined: 2 faults that did "
                  "not reproduce on replay (--quarantine_after=2); left out "
                  "of every later step", result.stderr)
    self.assertIn(_QUARANTINED, result.stderr)  # The rebuilt step's line.
    summary = _summary(self.quarantined_dir)
    # Step 6's fault never happened: tower 2 was not built.
    self.assertEqual([0, 0, 2], summary["rejected_by_tower"])
    self.assertEqual((8, 0), (summary["applied_steps"],
                              summary["skipped_steps"]))
    records = skip_log.read(skip_log.path(self.quarantined_dir, 0))
    self.assertEqual([2, 4], [r["step"] for r in records])

  def testKeptOnRestartItsTowerRunsNoNodeAndReadsNoInput(self):
    # In process: the claim is the trainer's; the binary's line is above.
    train_dir = self._copy_of_the_quarantined_run()
    traced = _TraceOneStep()
    with self.assertLogs(level="WARNING") as logs:
      summary = train_lib.train(_params(train_dir, max_steps=10,
                                        inject_nonfinite=""),
                                extra_hooks=[traced])
    self.assertEqual(1, "\n".join(logs.output).count(_QUARANTINED),
                     logs.output)
    self.assertEqual(10, summary["applied_steps"])
    # The restart's second step, as the runner runs it: tower 2 (kept
    # quarantined) executed no node and read no input.
    nodes = [n for d in traced.metadata.step_stats.dev_stats
             for n in d.node_stats]
    names = [n.node_name for n in nodes]
    self.assertEmpty([n for n in names if n.startswith("tower_2/")])
    self.assertNotEmpty([n for n in names if n.startswith("tower_1/")])
    self.assertLen([n for n in nodes
                    if " = IteratorGetNext(" in n.timeline_label],
                   2)

  def testClearQuarantineStartsOverAndInputFaultsNeverCount(self):
    # One run proves both: on a copy of the quarantined run, cleared, input
    # faults on tower 2 at three steps in a row (one more than
    # --quarantine_after): each reproduces on replay (the data), none
    # counts, the tower is never quarantined again.
    train_dir = self._copy_of_the_quarantined_run()
    self.assertEqual([0, 0, 2], _suspect_faults(train_dir))
    with self.assertLogs(level="WARNING") as logs:
      summary = train_lib.train(_params(
          train_dir, max_steps=11, inject_nonfinite="nan@8-10:2",
          inject_into="input", clear_quarantine=True))
    self.assertNotIn("quarantined", "\n".join(logs.output))
    # Tower 2 is built again (its three faults rejected, after the first
    # run's two), and its count starts over at 0, which input faults never
    # raise.
    self.assertEqual([0, 0, 5], summary["rejected_by_tower"])
    self.assertEqual([0, 0, 0], _suspect_faults(train_dir))
    records = skip_log.read(skip_log.path(train_dir, 0))[2:]
    self.assertEqual([8, 9, 10], [r["step"] for r in records])
    self.assertEqual([True] * 3, [r["reproduced"] for r in records])


# `//:train`'s main with TRAP run first (argv: its flags): it patches the
# quarantine to send a signal at the decision or at the rebuild.
_DRIVER = r"""
import os, signal
from absl import app
from tf1_safe_train import cli, train
from tf1_safe_train.trainer.tower import quarantine
%s
app.run(train.main, flags_parser=cli.flags_parser("train"))
"""
# Signal SIG right after the decision's line (a hook at the decision).
_AT_DECISION = """
decide = quarantine.Quarantine.on_suspect
def on_suspect(self, run_context, tower):
  decide(self, run_context, tower)
  if self.restart:
    os.kill(os.getpid(), signal.%s)
quarantine.Quarantine.on_suspect = on_suspect
"""
# SIGTERM while the step is rebuilt (the second segment's quarantine).
_AT_REBUILD = """
start = quarantine.Quarantine.__init__
segments = []
def __init__(self, *args):
  segments.append(self)
  if len(segments) == 2:
    os.kill(os.getpid(), signal.SIGTERM)
  start(self, *args)
quarantine.Quarantine.__init__ = __init__
"""
_TINY = ("--model=small_cnn", "--batch_size=8", "--device=cpu",
         "--skip_unit=tower", "--quarantine_after=1",
         "--save_checkpoints_steps=100", "--log_every_n_steps=100")
_NOT_QUARANTINED = ("tower 1 (/device:CPU:1): 1 faults that did not "
                    "reproduce, but not quarantined: 1 towers would be left")


class AcrossRestartsTest(tf.test.TestCase):
  """A restart (or the rebuild) decides as the run did, a decision outlives
  a SIGKILL, the rebuilt input goes on, a signal at the decision stops."""

  def _run(self, *args, code=None, **kwargs):
    train_dir = kwargs.pop("train_dir", None) or tempfile.mkdtemp(
        dir=self.get_temp_dir())
    args = ("--train_dir=" + train_dir,) + _TINY + args
    if code is None:
      return train_dir, binaries.run("train", *args, timeout=600)
    return train_dir, binaries.run_code(_DRIVER % code, *args, timeout=600)

  def _restart(self, train_dir, max_steps, *args):
    """Resumes `train_dir` without a drill; checks it ends well."""
    _, result = self._run("--max_steps=%d" % max_steps, *args,
                          train_dir=train_dir)
    self.assertEqual(result.returncode, 0, result.stderr)
    summary = _summary(train_dir)
    self.assertEqual(("max_steps", max_steps),
                     (summary["exit_reason"], summary["global_step"]))
    return result, summary

  # Item 1: the restart applies the run's floor (at least 2 towers left).
  # It quarantined tower 1 (count 1 saved) and died on the checkpoint's
  # per-tower shapes ([2] vs [1]).
  def testARestartKeepsTheLastTwoTowers(self):
    train_dir, first = self._run("--num_towers=2", "--max_steps=4",
                                 "--inject_nonfinite=nan@2:1")
    self.assertEqual(first.returncode, 0, first.stderr)
    self.assertIn(_NOT_QUARANTINED, first.stderr)
    result, summary = self._restart(train_dir, 6, "--num_towers=2")
    self.assertIn(_NOT_QUARANTINED, result.stderr)  # The same rule.
    self.assertEqual([], summary["quarantined_towers"])
    self.assertEqual((6, 0), (summary["applied_steps"],
                              summary["skipped_steps"]))

  # Every tower at K: it quarantined both (no tower left: a TypeError).
  def testARestartWithEveryTowerAtKQuarantinesNone(self):
    train_dir, first = self._run("--num_towers=2", "--max_steps=4",
                                 "--inject_nonfinite=nan@1:0,nan@2:1")
    self.assertEqual(first.returncode, 0, first.stderr)
    self.assertEqual([1, 1], _suspect_faults(train_dir))
    result, summary = self._restart(train_dir, 6, "--num_towers=2")
    self.assertNotIn("quarantined towers", result.stderr)
    self.assertEqual([], summary["quarantined_towers"])
    self.assertEqual(6, summary["applied_steps"])

  # 4 towers, --min_healthy_towers=3: the run quarantined tower 3 and kept
  # tower 2 (the floor); the restart quarantined both, built 2 towers and
  # skipped every step.
  def testARestartKeepsMinHealthyTowers(self):
    flags = ("--num_towers=4", "--min_healthy_towers=3")
    train_dir, first = self._run("--max_steps=5", "--inject_nonfinite="
                                 "nan@1:3,nan@3:2", *flags)
    self.assertEqual(first.returncode, 0, first.stderr)
    self.assertEqual([0, 0, 1, 1], _suspect_faults(train_dir))
    result, summary = self._restart(train_dir, 8, *flags)
    self.assertIn("quarantined towers (--quarantine_after=1, kept from the "
                  "checkpoint; --clear_quarantine starts over): 3 "
                  "(/device:CPU:3)\n", result.stderr)
    self.assertIn("tower 2 (/device:CPU:2): 1 faults that did not reproduce, "
                  "but not quarantined: 2 towers would be left",
                  result.stderr)
    self.assertEqual([3], summary["quarantined_towers"])
    # The one skip is the first run's step 3 (2 healthy towers of 3 built,
    # fewer than --min_healthy_towers); every step of the restart applied.
    self.assertEqual((7, 1), (summary["applied_steps"],
                              summary["skipped_steps"]))

  # Item 2: the decision is durable before its line: a SIGKILL right after
  # it (before any checkpoint holds the count) loses nothing. The restart
  # built all three towers.
  def testADecisionOutlivesASigkillRightAfterItsLine(self):
    train_dir, first = self._run(
        "--num_towers=3", "--max_steps=6", "--inject_nonfinite=nan@2:2",
        code=_AT_DECISION % "SIGKILL")
    self.assertEqual(first.returncode, -signal.SIGKILL, first.stderr)
    self.assertIn("tower 2 (/device:CPU:2) quarantined: 1 faults",
                  first.stderr)
    result, summary = self._restart(train_dir, 4, "--num_towers=3")
    self.assertIn("quarantined towers (--quarantine_after=1, kept from the "
                  "checkpoint; --clear_quarantine starts over): 2 "
                  "(/device:CPU:2)", result.stderr)
    self.assertEqual([2], summary["quarantined_towers"])

  # Item 3: the rebuilt step's towers read the next batches of the input.
  # Step 5's tower 1 read step 0's tower-1 batch again (the same ids).
  def testTheRebuiltInputFeedsNoExampleTwice(self):
    train_dir, result = self._run(
        "--num_towers=3", "--max_steps=8", "--quarantine_after=2",
        "--inject_nonfinite=nan@0:1,nan@3-4:2,nan@5:1")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("tower 2 (/device:CPU:2) quarantined", result.stderr)
    fed = [(r["step"], t["index"], t["example_ids"])
           for r in skip_log.read(skip_log.path(train_dir, 0))
           for t in r["towers"]]
    # Each record has every built tower's batch: 3 towers at steps 0, 3
    # and 4, then 2 (rebuilt without tower 2) at step 5.
    self.assertEqual([(0, 0), (0, 1), (0, 2), (3, 0), (3, 1), (3, 2),
                      (4, 0), (4, 1), (4, 2), (5, 0), (5, 1)],
                     [(step, tower) for step, tower, _ in fed])
    ids = [i for _, _, batch in fed for i in batch]
    self.assertLen(ids, 11 * 8)
    self.assertLen(set(ids), 11 * 8, fed)

  # Item 4: SIGTERM at the decision was logged and then lost with the
  # segment's hook (the run went on to --max_steps).
  def testASigtermAtTheDecisionStopsTheRun(self):
    self._assert_stopped(*self._run(
        "--num_towers=3", "--max_steps=30", "--inject_nonfinite=nan@2:2",
        code=_AT_DECISION % "SIGTERM"))

  # SIGTERM while the step is rebuilt: it found no handler of the run's
  # (exit 143, no line).
  def testASigtermDuringTheRebuildStopsTheRun(self):
    self._assert_stopped(*self._run(
        "--num_towers=3", "--max_steps=30", "--inject_nonfinite=nan@2:2",
        code=_AT_REBUILD))

  # The record is read back like skips.jsonl: not a file, or not a record,
  # is refused in one line (a TrainDirError: exit 2), before the graph.
  def testABadRecordIsRefused(self):
    for make, problem in (
        (os.mkdir, "is a directory"),
        (lambda p: open(p, "w").write('{"towers": [1.5]}'),
         "is not a quarantine record")):
      train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
      open(os.path.join(train_dir, "run_summary.json"), "w").close()  # Ours.
      make(os.path.join(train_dir, quarantine.RECORD))
      with self.assertRaisesRegex(train_lib.TrainDirError, problem):
        train_lib.train(_params(train_dir, clear_quarantine=(
            problem == "is a directory")))

  def _assert_stopped(self, train_dir, result):
    """A clean stop within a step of the decision (at step 2)."""
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("tower 2 (/device:CPU:2) quarantined", result.stderr)
    self.assertIn("stopping after this step", result.stderr)
    self.assertIn("run summary: ", result.stderr.strip().splitlines()[-1])
    summary = _summary(train_dir)
    self.assertEqual("interrupted", summary["exit_reason"])
    self.assertBetween(summary["global_step"], 3, 4)
    self.assertEqual(summary["global_step"], int(
        tf1.train.latest_checkpoint(train_dir).rsplit("-", 1)[1]))
    self.assertEqual(["quarantine.json"], [
        n for n in os.listdir(train_dir) if n.startswith("quarantine")])


if __name__ == "__main__":
  tf.test.main()
