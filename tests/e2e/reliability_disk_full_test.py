"""A full disk: named as such, the skip records kept, the saver's end fatal.

TensorFlow reports a write to a full disk as `ResourceExhaustedError`, the
class of a failed allocation; the trainer used to call it "out of memory"
and advise a smaller batch. The real thing runs `//:train` on a 20 MB tmpfs
mounted in a mount namespace of its own (`unshare --mount`: nothing is left
mounted whatever happens to the test); where the machine does not allow
that, the test is skipped. An explained skip whose state cannot be saved is
injected (ENOSPC) in-process.
"""

import errno
import os
import tempfile
from unittest import mock

import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import mount_namespace
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.explain import forensics
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import skip_states
from tf1_safe_train.trainer.run import train_lib

_NO_SPACE = os.strerror(errno.ENOSPC)


class DiskFullTest(tf.test.TestCase, binaries.OneLineErrorAssertions):

  # Regression test (issue 23, 4): on a 20 MB train_dir the second
  # checkpoint (14 MB; here at step 1) does not fit: `train: error: out of memory
  # (ResourceExhaustedError: ... No space left on device) ...; lower
  # --batch_size`. The saver's failure stays fatal, with one line saying
  # disk full and the file it could not write.
  def testCheckpointOnFullDiskSaysDiskFullAndWhere(self):
    if not mount_namespace.available():
      self.skipTest("cannot mount a tmpfs in a mount namespace here")
    mount_point = tempfile.mkdtemp(dir=self.get_temp_dir())
    copy = tempfile.mkdtemp(dir=self.get_temp_dir())
    train_dir = os.path.join(mount_point, "run")
    result = mount_namespace.run(binaries.command("train") + [
        "--train_dir=" + train_dir, "--num_towers=2", "--device=cpu",
        "--batch_size=8", "--max_steps=3", "--save_checkpoints_steps=1",
        "--save_summaries_steps=1000"], tmpfs=("20m", mount_point),
                                 copy_out=(mount_point, copy))
    self.assertNotEqual(result.returncode, mount_namespace.SETUP_FAILED,
                        result.stderr)
    self.assertOneLineError(result, "train: error: disk full (%s) writing %s/"
                            % (_NO_SPACE, train_dir), exit_code=1)
    error = binaries.error_lines(result.stderr)[0]
    self.assertIn("model.ckpt-", error)
    self.assertNotIn("out of memory", error)
    self.assertNotIn("--batch_size", error)
    self.assertIn("the last complete checkpoint there is intact", error)
    self.assertIn("model.ckpt-0.index", os.listdir(os.path.join(copy, "run")))


class SkipStateOnFullDiskTest(tf.test.TestCase):

  # Regression test (issue 23, 4): with a 40 MB train_dir the save of
  # skips/step-6/state ended the whole run and the step-6 record was never
  # written. The record is appended without state (saying why) and the run
  # goes on.
  def testSkipWhoseStateCannotBeSavedIsRecordedAndTheRunGoesOn(self):
    train_dir = os.path.join(self.get_temp_dir(), "state")

    def full_disk(train_dir_, worker, step, *unused):
      del train_dir_, worker, unused
      raise OSError(errno.ENOSPC, _NO_SPACE, os.path.join(
          train_dir, forensics.SKIPS_DIR, "step-%d" % step, "batch.npz"))

    params = params_lib.TrainParams(
        train_dir=train_dir, num_towers=2, device="cpu", batch_size=4,
        max_steps=5, save_checkpoints_steps=1000, save_summaries_steps=1000,
        log_every_n_steps=1000, inject_nonfinite="nan@1:0,nan@3:1",
        max_consecutive_skips=0).validate()
    with mock.patch.object(skip_states, "save", full_disk):
      summary = train_lib.train(params)
    self.assertEqual(summary["exit_reason"], "max_steps")
    self.assertEqual(summary["global_step"], 5)
    self.assertEqual(summary["skipped_steps"], 2)
    records = skip_log.read_all(train_dir)
    self.assertEqual([r["step"] for r in records], [1, 3])
    for record in records:
      self.assertIsNone(record["state_dir"])
      self.assertEqual(
          record["state_error"], "disk full (%s) writing %s" % (
              _NO_SPACE, os.path.join(train_dir, forensics.SKIPS_DIR,
                                      "step-%d" % record["step"],
                                      "batch.npz")))
      self.assertIn("verdict", record)  # Explained all the same.
      self.assertIn("replay", record)


if __name__ == "__main__":
  tf.test.main()
