"""--quarantine_after=K: a tower whose faults never reproduce is left out.

Through //:train (the quarantine), then in process on copies of that run
(a restart that keeps it, the clear) and alone (what a step without the
tower executes, input faults).
"""

import json
import os
import shutil
import tempfile

import tensorflow as tf

from bench import executed_ops
from tests import binaries
from tests import forensics_test_util
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer import local_replication
from tf1_safe_train.trainer import towers
from tf1_safe_train.trainer import train_lib
from tf1_safe_train.trainer import train_step

tf1 = tf.compat.v1

# Tower 3's gradients poisoned on three steps (a grads drill never
# reproduces on replay: a suspect device each time).
_DRILL = "nan@2:3,nan@4:3,nan@6:3"
_FLAGS = ("--num_towers=4", "--device=cpu", "--batch_size=2",
          "--skip_unit=tower", "--quarantine_after=2",
          "--save_checkpoints_steps=100", "--log_every_n_steps=100")
_QUARANTINED = ("quarantined towers (--quarantine_after=2, kept from the "
                "checkpoint; --clear_quarantine starts over): 3 "
                "(/device:CPU:3)")


def _params(train_dir, **overrides):
  values = dict(num_towers=4, batch_size=2, max_steps=8, skip_unit="tower",
                quarantine_after=2, inject_nonfinite=_DRILL)
  values.update(overrides)
  return forensics_test_util.params(train_dir, **values)


def _summary(train_dir):
  with open(os.path.join(train_dir, "run_summary.json")) as f:
    return json.load(f)


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
    self.assertIn("tower 3 (/device:CPU:3) quarantined: 2 faults that did "
                  "not reproduce on replay (--quarantine_after=2); left out "
                  "of every later step", result.stderr)
    self.assertIn(_QUARANTINED, result.stderr)  # The rebuilt step's line.
    summary = _summary(self.quarantined_dir)
    # Step 6's fault never happened: tower 3 was not built.
    self.assertEqual([0, 0, 0, 2], summary["rejected_by_tower"])
    self.assertEqual((8, 0), (summary["applied_steps"],
                              summary["skipped_steps"]))
    records = skip_log.read(skip_log.path(self.quarantined_dir, 0))
    self.assertEqual([2, 4], [r["step"] for r in records])

  def testKeptOnRestart(self):
    # In process: the claim is the trainer's; the binary's line is above.
    train_dir = self._copy_of_the_quarantined_run()
    with self.assertLogs(level="WARNING") as logs:
      summary = train_lib.train(_params(train_dir, max_steps=10,
                                        inject_nonfinite=""))
    self.assertEqual(1, "\n".join(logs.output).count(_QUARANTINED),
                     logs.output)
    self.assertEqual(10, summary["applied_steps"])

  def testInputFaultsNeverQuarantine(self):
    train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    summary = train_lib.train(_params(train_dir, inject_into="input"))
    self.assertEqual([0, 0, 0, 3], summary["rejected_by_tower"])
    records = skip_log.read(skip_log.path(train_dir, 0))
    self.assertEqual([True] * 3, [r["reproduced"] for r in records])

  def testClearQuarantineStartsOver(self):
    train_dir = self._copy_of_the_quarantined_run()
    with self.assertLogs(level="WARNING") as logs:
      summary = train_lib.train(_params(
          train_dir, max_steps=12, inject_nonfinite="nan@10:3",
          clear_quarantine=True))
    self.assertNotIn("quarantined towers", "\n".join(logs.output))
    # Tower 3 is built again, and its fault counts once (not quarantined).
    self.assertEqual([0, 0, 0, 3], summary["rejected_by_tower"])

  def testAQuarantinedTowerRunsNoNodeAndReadsNoInput(self):
    params = _params("/tmp/unused", inject_nonfinite="")
    config = towers.TowerConfig(4, "cpu")
    with tf.Graph().as_default():
      step = train_step.build_step(params, local_replication.Local(params, config),
                                   quarantined=(3,))
      with tf1.Session(config=towers.session_config(config)) as sess:
        sess.run([tf1.global_variables_initializer(),
                  tf1.local_variables_initializer()])
        sess.run(step.train_op)
        metadata = executed_ops.trace_run(sess, {"train": step.train_op,
                                                 "applied": step.applied})
    nodes = [n for d in metadata.step_stats.dev_stats for n in d.node_stats]
    names = [n.node_name for n in nodes]
    self.assertEmpty([n for n in names if n.startswith("tower_3/")])
    self.assertNotEmpty([n for n in names if n.startswith("tower_2/")])
    self.assertLen([n for n in nodes
                    if " = IteratorGetNext(" in n.timeline_label],
                   3)


if __name__ == "__main__":
  tf.test.main()
