"""`//:eval` on an archived run: a read-only train_dir is evaluated as is.

Evaluation only reads the train_dir; its TensorBoard scalars go to
`<train_dir>/eval/` when the train_dir is writable, and are left out (one
warning) when it is not. The read-only train_dir is a read-only bind mount
in a mount namespace of the eval process only (`mount_namespace`).
"""

import os
import shutil
import tempfile

from absl import logging
import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import mount_namespace
from tf1_safe_train.trainer.run import eval_lib
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1


def _listing(directory):
  """{relative path: (size, mtime)} of every file under `directory`."""
  found = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      info = os.stat(path)
      found[os.path.relpath(path, directory)] = (info.st_size,
                                                 info.st_mtime_ns)
  return found


class EvalReadOnlyTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # A finished 2-step run, trained once; each test evaluates a copy.
    cls.template = os.path.join(
        tempfile.mkdtemp(dir=tf1.test.get_temp_dir()), "run")
    train_lib.train(params_lib.TrainParams(
        train_dir=cls.template, num_towers=1, device="cpu", batch_size=4,
        max_steps=2, save_summaries_steps=1000,
        log_every_n_steps=1000).validate())

  def _finished_run(self, name):
    train_dir = os.path.join(self.get_temp_dir(), name)
    shutil.copytree(self.template, train_dir)
    return train_dir

  # Regression test (issue 23, 9): //:eval wrote its summary into the
  # train_dir and failed on an archived, read-only run.
  def testEvaluatesReadOnlyTrainDirAndWritesNothingThere(self):
    if not mount_namespace.available():
      self.skipTest("cannot mount in a mount namespace here")
    train_dir = self._finished_run("archived")
    before = _listing(train_dir)
    result = mount_namespace.run(binaries.command("eval") + [
        "--train_dir=" + train_dir, "--batch_size=50", "--max_examples=100"],
                                 read_only=[train_dir])
    self.assertNotEqual(result.returncode, mount_namespace.SETUP_FAILED,
                        result.stderr)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertNotIn("Traceback", result.stderr)
    self.assertIn("eval: step 2  precision@1 ", result.stdout)
    self.assertIn("eval scalars for TensorBoard not written to %s" %
                  os.path.join(train_dir, "eval"), result.stderr)
    self.assertEqual(_listing(train_dir), before)

  # In-process (`eval_lib.evaluate`, what //:eval calls): where the scalars
  # go is the library's; the binary's exit code and its result line are
  # proven by the read-only run above.
  def testWritesItsScalarsIntoAWritableTrainDir(self):
    train_dir = self._finished_run("writable")
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      logging.info("evaluating %s", train_dir)  # assertLogs needs one line.
      result = eval_lib.evaluate(params_lib.EvalParams(
          train_dir=train_dir, batch_size=50, max_examples=100))
    self.assertEqual(result["global_step"], 2)
    for line in logs.output:
      self.assertNotIn("not written", line)
    self.assertNotEmpty(os.listdir(os.path.join(train_dir, "eval")))

if __name__ == "__main__":
  tf.test.main()
