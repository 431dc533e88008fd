"""`choose_checkpoint`: the newest qualifying ancestor, never an abandoned one.

Synthetic train_dirs of small checkpoints holding only what it reads (the
counters, the rollback state and a weight), laid out as a run writes them.
"""

import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from tf1_safe_train.trainer.recovery import checkpoint_rollback_target
from tf1_safe_train.trainer.inputs import checkpoint_rollback_window

tf1 = tf.compat.v1


def _fake_checkpoint(train_dir, step, applied, rollbacks=None,
                     rollback_to_step=None):
  """model.ckpt-`step`; without `rollbacks`, as a run without rollback."""
  with tf.Graph().as_default():
    names = {"global_step": step, "applied_steps": applied,
             "rollbacks": rollbacks, "rollback_to_step": rollback_to_step}
    variables = [tf1.Variable(np.int64(v), name=n)
                 for n, v in names.items() if v is not None]
    variables.append(tf1.Variable(np.full([2], step, np.float32), name="w"))
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      tf1.train.Saver(variables).save(
          session, os.path.join(train_dir, "model.ckpt"), global_step=step)


class OneRollbackTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    # Rolled back once, at step 24, to model.ckpt-15: model.ckpt-20 holds
    # the abandoned window, model.ckpt-25 the model restored then.
    self.train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    for step, applied, rollbacks in ((10, 10, 0), (15, 15, 0), (20, 20, 0),
                                     (25, 15, 1), (30, 20, 1)):
      _fake_checkpoint(self.train_dir, step, applied, rollbacks,
                       15 if rollbacks else -1)

  def choose(self, max_applied, at_step=35):
    path, step, applied = checkpoint_rollback_target.choose_checkpoint(
        self.train_dir, at_step, max_applied, rollbacks=1, rollback_to_step=15)
    return (os.path.basename(path), step, applied) if path else step

  def testNewestAncestorWithFewEnoughAppliedSteps(self):
    self.assertEqual(self.choose(20), ("model.ckpt-30", 30, 20))
    self.assertEqual(self.choose(19), ("model.ckpt-25", 25, 15))

  def testNeverTheAbandonedWindow(self):
    # model.ckpt-20 has few enough applied steps and is the newest before
    # step 25, but the rollback abandoned it.
    self.assertEqual(self.choose(20, at_step=25), ("model.ckpt-15", 15, 15))
    self.assertEqual(self.choose(14), ("model.ckpt-10", 10, 10))

  def testNoneQualifies(self):
    self.assertIn("qualifies", self.choose(9))


# Two rollbacks (saves every 5 steps), as `RollbackHook` leaves them:
#   lineage 0: 5, 10, 15 ancestors; 20 and 25 (saved at step 25 just before
#     rollback 1, at step 25, restored model.ckpt-15) abandoned;
#   lineage 1 (rollbacks 1, rollback_to_step 15): 30 an ancestor, 35
#     abandoned by rollback 2 (at step 40, restored model.ckpt-30);
#   lineage 2 (rollbacks 2, rollback_to_step 30): 40 (saved at step 40 just
#     after rollback 2: the model it restored), 45.
# The abandoned checkpoints are finite and hold few applied steps (fewer
# than any ancestor could), so only the ancestry keeps them out.
_ABANDONED = (20, 25, 35)
_HISTORY = (  # step, applied, rollbacks, rollback_to_step
    (5, 5, None, None), (10, 10, None, None), (15, 15, None, None),
    (20, 3, None, None), (25, 3, None, None),
    (30, 20, 1, 15), (35, 3, 1, 15),
    (40, 20, 2, 30), (45, 25, 2, 30))


class TwoRollbacksTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    self.train_dir = tempfile.mkdtemp(dir=self.get_temp_dir())
    for values in _HISTORY:
      _fake_checkpoint(self.train_dir, *values)
    checkpoint_rollback_window.append(self.train_dir, 25, [15, 24], [1, 2], 0)
    checkpoint_rollback_window.append(self.train_dir, 40, [30, 39], [3, 4], 0)

  def choose(self, max_applied, at_step=48):
    """A third rollback at `at_step`, state as rollback 2 left it."""
    path, step, _ = checkpoint_rollback_target.choose_checkpoint(
        self.train_dir, at_step, max_applied, rollbacks=2, rollback_to_step=30)
    return os.path.basename(path) if path else step

  def testAnAncestorOfEveryEarlierLineageQualifies(self):
    self.assertEqual(self.choose(25), "model.ckpt-45")
    # Written just after rollback 2, at its own step: an ancestor.
    self.assertEqual(self.choose(20), "model.ckpt-40")
    self.assertEqual(self.choose(20, at_step=40), "model.ckpt-30")
    # Written with rollbacks 0, before both rollbacks' restored steps.
    self.assertEqual(self.choose(19), "model.ckpt-15")
    self.assertEqual(self.choose(12), "model.ckpt-10")
    self.assertEqual(self.choose(5), "model.ckpt-5")
    self.assertIn("qualifies", self.choose(4))

  def testNeverAnAbandonedWindow(self):
    for max_applied in range(3, 26):
      for at_step in (26, 36, 41, 48):
        self.assertNotIn(self.choose(max_applied, at_step),
                         ["model.ckpt-%d" % s for s in _ABANDONED])

  def testTheWindowsFileIsNotNeeded(self):
    # A copied train_dir without it, or a damaged one: the checkpoints say
    # what each descends from.
    chosen = [self.choose(a) for a in (25, 20, 12, 5, 4)]
    os.remove(checkpoint_rollback_window.path(self.train_dir))
    self.assertEqual([self.choose(a) for a in (25, 20, 12, 5, 4)], chosen)

  def testAWindowACrashLeftUnrecordedAbandonsNothing(self):
    # A rollback at step 48 appended its window (to model.ckpt-10), then a
    # SIGKILL came before any checkpoint recorded it; the restarted run
    # resumed from model.ckpt-45 and wrote model.ckpt-50: still ancestors.
    checkpoint_rollback_window.append(self.train_dir, 48, [10, 47], [5], 0)
    _fake_checkpoint(self.train_dir, 50, 26, 2, 30)
    self.assertEqual(self.choose(26, at_step=55), "model.ckpt-50")
    self.assertEqual(self.choose(25, at_step=55), "model.ckpt-45")

  def _remove(self, step):
    for name in os.listdir(self.train_dir):
      if name.startswith("model.ckpt-%d." % step):
        os.remove(os.path.join(self.train_dir, name))

  def testAPrunedLinkTrustsNothingOlderThanItsLineage(self):
    # keep_checkpoint_max prunes the oldest first. Without model.ckpt-15
    # (what rollback 1 restored) the lineage just before rollback 1 is
    # still known: up to step 15, the checkpoints holding rollbacks 0.
    self._remove(15)
    self.assertEqual(self.choose(19), "model.ckpt-10")
    # Without model.ckpt-30 (what rollback 2 restored), what it descends
    # from is unknown: nothing before it qualifies.
    self._remove(30)
    self.assertEqual(self.choose(20), "model.ckpt-40")
    self.assertIn("qualifies", self.choose(19))

  def testADamagedLinkTrustsNothingOlderThanItsLineage(self):
    path = os.path.join(self.train_dir, "model.ckpt-30.index")
    with open(path, "r+b") as f:
      f.write(b"\0" * os.path.getsize(path))
    self.assertEqual(
        checkpoint_rollback_target.lineages(
            self.train_dir, {30: "model.ckpt-30"}, 2, 30),
        [(2, None), (1, 30)])
    self.assertIn("qualifies", self.choose(19))


if __name__ == "__main__":
  tf.test.main()
