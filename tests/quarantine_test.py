"""--quarantine_after=K: a tower whose faults never reproduce is left out.

Through //:train (the quarantine), then in process on copies of that run:
a restart that keeps it (and what its steps execute without the tower),
and a clear whose input faults never count.
"""

import json
import os
import shutil
import tempfile

import tensorflow as tf

from tests import binaries
from tests import forensics_test_util
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer import quarantine
from tf1_safe_train.trainer import train_lib

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
  return forensics_test_util.params(train_dir, **values)


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


if __name__ == "__main__":
  tf.test.main()
