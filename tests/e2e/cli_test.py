"""The binaries as users run them: flags, and one-line errors on bad input."""

import json
import os
import re
import subprocess
import sys
from unittest import mock

import numpy as np
import tensorflow as tf

from tests.fixtures import binaries
from tf1_safe_train import console
from tf1_safe_train import models
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.data import cifar10
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.config import params
from tf1_safe_train.trainer.config import preflight


class TrainCliTest(tf.test.TestCase, binaries.OneLineErrorAssertions):

  def _existing_run(self):
    """A train_dir holding checkpoint files that must survive bad input."""
    train_dir = os.path.join(self.get_temp_dir(), "existing")
    os.makedirs(train_dir, exist_ok=True)
    contents = {"checkpoint": b'model_checkpoint_path: "model.ckpt-5"\n',
                "model.ckpt-5.index": b"\x00index",
                "model.ckpt-5.data-00000-of-00001": b"\x01data"}
    for name, data in contents.items():
      with open(os.path.join(train_dir, name), "wb") as f:
        f.write(data)
    return train_dir, contents

  def assertUntouched(self, train_dir, contents):
    self.assertCountEqual(os.listdir(train_dir), list(contents))
    for name, data in contents.items():
      with open(os.path.join(train_dir, name), "rb") as f:
        self.assertEqual(f.read(), data, name)

  def testHelpfullListsTheFlags(self):
    result = binaries.run("train", "--helpfull", fresh_process=True)
    self.assertEqual(result.returncode, 0, result.stderr)
    for flag in ("--num_towers", "--inject_nonfinite", "--max_consecutive_skips",
                 "increment_global_step_on_skip", "--train_dir"):
      self.assertIn(flag, result.stdout)

  # Regression test (issue 37, 8): --help was one alphabetical list of the
  # 48 flags (--batch_size first), without -v or --flagfile. It lists them
  # by concept, the run's common flags first, each flag once, then absl's.
  def testHelpListsTheFlagsByConceptCommonOnesFirst(self):
    result = binaries.run("train", "--help", no_tensorflow=True)
    self.assertEqual(result.returncode, 0, result.stderr)
    lines = result.stdout.splitlines()
    listed = [re.match(r"^  --(?:\[no\])?(\w+):", l).group(1)
              for l in lines if re.match(r"^  --(?:\[no\])?\w+:", l)]
    self.assertEqual(listed[:4], ["train_dir", "model", "max_steps",
                                  "batch_size"])
    self.assertCountEqual(listed, [
        s.name for s in flag_specs.of_params(params.TrainParams) +
        cluster_flags.FLAGS])
    self.assertLess(lines.index("The run:"), lines.index("Optimization:"))
    self.assertLess(lines.index("Optimization:"),
                    lines.index("Several machines:"))
    for absl_flag in ("-v/--verbosity", "--flagfile", "--helpfull"):
      self.assertIn(absl_flag, result.stdout)

  # Regression test (issue 37, 8): tf_cnn_benchmarks' names got absl's
  # "'num_batches'. Did you mean: num_towers ?" and "'use_fp16'. Did you
  # mean: use_cprofile_for_profiling ?". One line names our flag.
  def testTfCnnBenchmarksFlagsAreAnsweredWithOurs(self):
    for arg, ours in (("--num_gpus=2", "here use --num_towers (with "
                       "--device=gpu"),
                      ("--num_batches=100", "here use --max_steps (the "
                       "global step to stop at"),
                      ("--use_fp16", "here use --precision=fp16")):
      with self.subTest(arg=arg):
        result = binaries.run("train", "--max_steps=3", arg,
                              no_tensorflow=True)
        self.assertOneLineError(result, "train: error: %s is "
                                "tf_cnn_benchmarks' flag; %s" % (
                                    arg.split("=")[0], ours), exit_code=2)

  def testUnknownFlag(self):
    self.assertOneLineError(binaries.run("train", "--no_such_flag=1",
                                         fresh_process=True),
                            "no_such_flag")

  def testBadFlagValues(self):
    train_dir, contents = self._existing_run()
    cases = [
        (["--num_towers=abc"], "num_towers"),
        (["--num_towers=-1"], "--num_towers=-1"),
        (["--num_towers=0"], "--num_towers=0"),
        (["--batch_size=0"], "--batch_size=0"),
        (["--device=gpu", "--num_towers=2"], "GPU"),
        (["--dataset=cifar10"], "--data_dir"),
        (["--inject_nonfinite=nan@x:1"], "nan@x:1"),
        (["--inject_nonfinite=nan@3:7"], "TOWER 7 out of range"),
        (["--model=vgg"], "vgg"),
        # Every task of a cluster checks the drill against its workers.
        (["--inject_nonfinite=nan@3:0/1", "--ps_hosts=127.0.0.1:1",
          "--worker_hosts=127.0.0.1:2", "--job_name=ps", "--task_index=0"],
         "WORKER 1 out of range, there are 1"),
    ]
    # Refused before TensorFlow's import (`preflight`): it cannot be
    # imported here, so a later refusal would end in a traceback. (Only
    # TensorFlow can count the GPUs of a machine with a GPU device node.)
    gpu_known = preflight.visible_gpus("gpu") is not None
    for args, expected in cases:
      with self.subTest(args=args):
        result = binaries.run(
            "train", "--train_dir=" + train_dir, *args,
            no_tensorflow=gpu_known or "--device=gpu" not in args,
            fresh_process=True)
        self.assertOneLineError(result, expected)
        self.assertUntouched(train_dir, contents)

  # Regression test (issue 23, 9): `--learning_rate=1e400` (which Python
  # reads as inf) was reported as `--learning_rate=inf`. The line names
  # what was typed and that it overflows; NaN and Inf as typed.
  def testNonFiniteFloatFlagNamesTheValueAsTyped(self):
    train_dir, contents = self._existing_run()
    cases = [
        (["--learning_rate=1e400"], "train: error: --learning_rate=1e400: "
         "must be a finite number (1e400 overflows a float"),
        (["--weight_decay", "-1E999"], "train: error: --weight_decay=-1E999: "
         "must be a finite number (-1E999 overflows a float"),
        (["--learning_rate=NaN"], "train: error: --learning_rate=NaN: must "
         "be a finite number"),
    ]
    for args, expected in cases:
      with self.subTest(args=args):
        result = binaries.run("train", "--train_dir=" + train_dir, *args,
                              fresh_process=True)
        self.assertOneLineError(result, expected, exit_code=2)
        self.assertStartsWith(binaries.error_lines(result.stderr)[0],
                              expected)
        self.assertUntouched(train_dir, contents)

  def testBadData(self):
    train_dir, contents = self._existing_run()
    data_dir = os.path.join(self.get_temp_dir(), "cifar")
    os.makedirs(data_dir)
    images = np.zeros((2, 32, 32, 3), np.uint8)
    for i in range(1, 6):
      cifar10.write_records(os.path.join(data_dir, "data_batch_%d.bin" % i),
                            images, [0, 1])
    with open(os.path.join(data_dir, "data_batch_3.bin"), "ab") as f:
      f.write(b"\x00" * 10)  # Truncated record: not a multiple of 3073.
    cases = [
        ("--data_dir=" + os.path.join(self.get_temp_dir(), "missing"),
         "missing"),
        ("--data_dir=" + data_dir, "data_batch_3.bin"),
    ]
    for data_arg, expected in cases:
      with self.subTest(data_arg=data_arg):
        result = binaries.run("train", "--train_dir=" + train_dir,
                              "--dataset=cifar10", data_arg,
                              fresh_process=True)
        self.assertOneLineError(result, expected)
        self.assertUntouched(train_dir, contents)

  def testUnwritableTrainDir(self):
    blocker = os.path.join(self.get_temp_dir(), "a_file")
    with open(blocker, "w") as f:
      f.write("not a directory")
    result = binaries.run("train",
                          "--train_dir=" + os.path.join(blocker, "run"),
                          no_tensorflow=True,  # Refused before its import.
                          fresh_process=True)
    self.assertOneLineError(result, "--train_dir", "not writable")


  # Regression test (issue 37, 9): a --train_dir that is a file said
  # `is not writable: File exists`.
  def testTrainDirThatIsAFile(self):
    path = os.path.join(self.get_temp_dir(), "a_file")
    with open(path, "w") as f:
      f.write("not a directory")
    result = binaries.run("train", "--train_dir=" + path,
                          no_tensorflow=True)  # Refused before its import.
    self.assertOneLineError(result, "--train_dir=%s is a file, not a "
                            "directory" % path, exit_code=2)

  # Regression test (issue 37, 4 and 9): without --train_dir a run resumed
  # the one fixed /tmp/tf1_safe_train silently (or ended at once, exit 0,
  # at its --max_steps); --num_towers beyond the cores ran without a word.
  # Now the first line names a fresh directory (under TMPDIR), the run
  # trains there, and one warning says the towers share the cores; in a
  # cluster --train_dir is required (every task names the same one).
  def testNoTrainDirIsFreshAndNamedFirstAndTowersBeyondCoresAreSaid(self):
    tmp = os.path.join(self.get_temp_dir(), "tmp")
    os.makedirs(tmp)
    towers = preflight.cpu_cores() + 1
    result = binaries.run("train", "--max_steps=1", "--batch_size=2",
                          "--device=cpu", "--num_towers=%d" % towers,
                          "--max_explained_skips=0", TMPDIR=tmp)
    self.assertEqual(result.returncode, 0, result.stderr)
    # Only ours: under Bazel a fresh process may leave its own files there.
    (fresh,) = [name for name in os.listdir(tmp)
                if name.startswith("tf1_safe_train")]
    train_dir = os.path.join(tmp, fresh)
    self.assertRegex(fresh, r"^tf1_safe_train-\d{8}-\d{6}-\d+$")
    self.assertEqual(binaries.our_lines(result.stderr)[0],
                     "train: --train_dir=%s (a fresh directory; pass "
                     "--train_dir to choose one, the same one to resume)" %
                     train_dir)
    with open(os.path.join(train_dir, "run_summary.json")) as f:
      self.assertEqual(json.load(f)["steps_this_run"], 1)
    warnings = [l for l in result.stderr.splitlines()
                if "--num_towers=%d on --device=cpu" % towers in l]
    self.assertLen(warnings, 1, result.stderr)
    self.assertIn("may use %d CPU core(s)" % preflight.cpu_cores(),
                  warnings[0])
    self.assertOneLineError(
        binaries.run("train", "--ps_hosts=127.0.0.1:1",
                     "--worker_hosts=127.0.0.1:2", "--job_name=worker",
                     no_tensorflow=True),
        "--train_dir is required in a cluster", exit_code=2)

  # One short run proves two things: a relative --train_dir resolves
  # against the directory `bazel run` ran from, and the first screen has no
  # deprecation notice. (TensorFlow prints each deprecated call once, with
  # a long build-cache path, before the first progress line: the README
  # shows a clean log.) Forked from the server (as the eval run below, which
  # shares its TensorFlow import): both are claims about the binary's code;
  # the real binaries start in the refusals above and in
  # readme_commands_test, whose quick start has no deprecation notice
  # either.
  def testRelativeTrainDirAndNoDeprecationWarnings(self):
    user_dir = os.path.join(self.get_temp_dir(), "user")
    os.makedirs(user_dir)
    result = binaries.run("train", "--train_dir=runs/a", "--max_steps=3",
                          "--batch_size=2", "--num_towers=2",
                          "--inject_nonfinite=nan@1:1",
                          BUILD_WORKING_DIRECTORY=user_dir)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertTrue(os.path.exists(
        os.path.join(user_dir, "runs", "a", "run_summary.json")))
    self.assertIn("skipped step 1", result.stderr)
    self.assertNotIn("is deprecated", result.stderr)


def _resnet8_run(train_dir):
  """A run's directory as a resnet8 run leaves it: an initialised resnet8
  checkpoint and the run_summary.json that records the model."""
  tf1 = tf.compat.v1
  os.makedirs(train_dir)
  with tf.Graph().as_default():
    models.get_model("resnet8")(tf1.placeholder(tf.float32, [1, 32, 32, 3]),
                                is_training=False)
    tf1.train.create_global_step()
    with tf1.Session() as session:
      session.run(tf1.global_variables_initializer())
      tf1.train.Saver().save(session, os.path.join(train_dir, "model.ckpt"),
                             global_step=0)
  with open(os.path.join(train_dir, "run_summary.json"), "w") as f:
    json.dump({"params": {"model": "resnet8", "dataset": "synthetic",
                          "data_dir": ""}}, f)


class LaunchTest(tf.test.TestCase, binaries.OneLineErrorAssertions):
  """How a binary was run: the command its --help names, TensorFlow
  missing (tests/e2e/pip_install_test.py runs the console scripts)."""

  def testWithoutTensorFlowOneLineSaysWhatToInstall(self):
    # A `tensorflow` whose import fails (binaries.env): the line names the
    # error and the package; one that is not there at all gets
    # NO_TENSORFLOW (tests/e2e/pip_install_test.py, a virtualenv without it).
    for binary in ("train", "eval"):
      with self.subTest(binary=binary):
        result = binaries.run(binary, "--train_dir=" + self.get_temp_dir(),
                              no_tensorflow=True, fresh_process=True)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        self.assertEqual(binaries.error_lines(result.stderr), [
            "%s: error: TensorFlow is installed but cannot be imported "
            "(ImportError: tensorflow was imported); reinstall the one "
            "tf1_safe_train is tested with (2.21): pip install "
            "tensorflow-cpu==2.21.* or 'tensorflow[and-cuda]==2.21.*' (or "
            "the extra tf1_safe_train[cpu] or [gpu])" % binary])

  def testHelpNamesTheCommandRun(self):
    result = subprocess.run(
        [sys.executable, "-m", "tf1_safe_train.train", "--help"],
        capture_output=True, text=True, env=binaries.env(), timeout=120,
        check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("\n  python -m tf1_safe_train.train --num_towers=2 ",
                  result.stdout)
    self.assertNotIn("bazelw", result.stdout)
    self.assertIn("--max_steps", result.stdout)

  def testVerbosityZeroBringsTensorFlowsInfoLinesBack(self):
    # The binaries hide TensorFlow's INFO lines (the quick start's first
    # screen has none: tests/e2e/readme_commands_test.py); absl's -v 0
    # shows them. A new process in the user's environment: the log level
    # is read when TensorFlow is imported.
    env = binaries.env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run(
        binaries.command("train") + [
            "--batch_size=2", "--num_towers=1", "-v", "0", "--max_steps=1",
            "--train_dir=" + os.path.join(self.get_temp_dir(), "verbose")],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    for chatter in ("Create CheckpointSaverHook", "Graph was finalized",
                    "Saving checkpoints for 1 into"):
      self.assertIn(chatter, result.stderr)

  def testCommandIsHowItWasLaunched(self):
    workspace = self.get_temp_dir()
    runfiles = os.path.join(workspace, "bazel-bin", "train.runfiles",
                            "tf1_safe_train", "tf1_safe_train", "train.py")
    cases = [
        (["/v/bin/python", "-m", "tf1_safe_train.eval", "--x"], {},
         "python -m tf1_safe_train.eval"),
        (["/v/bin/python", "-u", "-m", "tf1_safe_train.train"], {},
         "python -m tf1_safe_train.train"),
        (["/v/bin/python", "/v/bin/tf1-safe-train", "--help"], {},
         "tf1-safe-train"),
        # `bazel run` from another workspace (no ./bazelw there).
        (["/v/bin/python3", runfiles, "--help"],
         {"BUILD_WORKSPACE_DIRECTORY": workspace},
         "bazel run @tf1_safe_train//:train --"),
        (["/v/bin/python3", runfiles], {}, "./bazelw run //:train --"),
    ]
    for orig_argv, environ, expected in cases:
      with self.subTest(orig_argv=orig_argv), \
          mock.patch.object(sys, "orig_argv", orig_argv), \
          mock.patch.dict(os.environ, environ):
        if not environ:
          os.environ.pop("BUILD_WORKSPACE_DIRECTORY", None)
        self.assertEqual(console.command("train"), expected)
    with open(os.path.join(workspace, "bazelw"), "w"):
      pass
    with mock.patch.object(sys, "orig_argv", ["python3", runfiles]), \
        mock.patch.dict(os.environ, {"BUILD_WORKSPACE_DIRECTORY": workspace}):
      self.assertEqual(console.command("eval"), "./bazelw run //:eval --")


class EvalCliTest(tf.test.TestCase):

  # Regression test (issue 37, 4): //:eval had the fixed default
  # --train_dir=/tmp/tf1_safe_train, which a forgotten flag evaluated.
  def testTrainDirIsRequired(self):
    result = binaries.run("eval", no_tensorflow=True)  # Before the import.
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(binaries.error_lines(result.stderr), [
        "eval: error: --train_dir is required: the training run's "
        "directory"])

  # Regression test (issue 37, 5): on a resnet8 run, //:eval built small_cnn
  # (its --model default) and failed: `NotFoundError: Key
  # small_cnn/conv1/biases not found in checkpoint`. It reads the model
  # from run_summary.json, as //:replay reads a skip's params; a --model
  # that contradicts the run is refused in one line.
  def testEvaluatesTheModelTheRunRecorded(self):
    train_dir = os.path.join(self.get_temp_dir(), "resnet8")
    _resnet8_run(train_dir)
    result = binaries.run("eval", "--train_dir=" + train_dir,
                          "--max_examples=100")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertStartsWith(result.stdout, "eval: step 0  precision@1 ")
    result = binaries.run("eval", "--train_dir=" + train_dir,
                          "--model=small_cnn", no_tensorflow=True)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(binaries.error_lines(result.stderr), [
        "eval: error: --model=small_cnn, but the run in %s trained "
        "--model=resnet8 (run_summary.json): its checkpoint holds that "
        "graph; drop --model" % train_dir])
    # A run not finished yet has recorded nothing: --model's default is
    # built, and the line says to pass the run's.
    os.remove(os.path.join(train_dir, "run_summary.json"))
    result = binaries.run("eval", "--train_dir=" + train_dir)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(binaries.error_lines(result.stderr), [
        "eval: error: NotFoundError: Key small_cnn/conv1/biases not found "
        "in checkpoint: the checkpoint holds another model than "
        "--model=small_cnn; pass the run's --model"])

  def testMissingCheckpoint(self):
    result = binaries.run("eval", "--train_dir=" + self.get_temp_dir())
    self.assertNotEqual(result.returncode, 0)
    self.assertNotIn("Traceback", result.stderr)
    self.assertEqual(binaries.error_lines(result.stderr),
                     ["eval: error: no checkpoint in --train_dir=%s" %
                      self.get_temp_dir()])


if __name__ == "__main__":
  tf.test.main()
