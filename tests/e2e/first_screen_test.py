"""The quick start's first screen is the README's, and -v 0 adds TensorFlow's.

The README's quick-start command runs as written, but for a temporary
--train_dir and a --max_steps just past the drill's first skip; its first
lines (TensorFlow's notices, the banner, the first progress and skip lines)
must be the README's first-screen block, numbers aside (times, ids, losses,
rates) and the README's --train_dir in place of the temporary one, and no
INFO line or deprecation notice of TensorFlow may follow. With absl's --verbosity=0 TensorFlow's INFO lines come back.
"""

import os
import re
import shlex
import subprocess

import tensorflow as tf

from tests.fixtures import binaries

# Past the first skip the drill makes (step 78), which the block shows.
_MAX_STEPS = 80
# TensorFlow's INFO lines and deprecation notices (logged as warnings).
_TF_CHATTER = ("Create CheckpointSaverHook", "Graph was finalized",
               "local_init_op", "Calling checkpoint listeners",
               "Saving checkpoints for", "is deprecated")
# TensorFlow's oneDNN notice, printed only on CPUs where it turns oneDNN on.
_ONEDNN = re.compile(r"oneDNN custom operations|before absl::InitializeLog")


def _readme():
  root = os.environ.get("TEST_SRCDIR")
  if root:
    root = os.path.join(root, os.environ["TEST_WORKSPACE"])
  else:
    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
  with open(os.path.join(root, "README.md")) as f:
    return f.read()


def _quick_start_args(readme):
  """The trainer's arguments in the README's quick-start command."""
  command = re.search(r"^\./bazelw run //:train -- (.*)$", readme, re.M)
  return shlex.split(command.group(1))


def _first_screen(readme):
  """The lines of the README's first-screen block, up to its '...'."""
  block = re.search(r"<!-- first-screen:[^>]*-->\n```\n(.*?)```", readme,
                    re.S).group(1)
  lines = block.splitlines()
  return lines[:lines.index("...")] if "..." in lines else lines


def _numbers_aside(line):
  """`line` with each number a '#' (and the padding before numbers gone)."""
  return re.sub(r" +", " ", re.sub(r"\d+", "#", line))


def _run_train(args, train_dir, max_steps):
  """Runs //:train with `args`, its --train_dir and --max_steps replaced."""
  args = [a for a in args
          if not a.startswith(("--train_dir=", "--max_steps="))]
  env = binaries.env()
  # As a user runs it: the binaries' own default, not the tests' quiet one.
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  return subprocess.run(
      binaries.command("train") + args + [
          "--train_dir=" + train_dir, "--max_steps=%d" % max_steps],
      capture_output=True, text=True, env=env, timeout=600, check=False)


class FirstScreenTest(tf.test.TestCase):

  def testQuickStartPrintsTheReadmesFirstScreenAndNoChatter(self):
    readme = _readme()
    args = _quick_start_args(readme)
    train_dir = os.path.join(self.get_temp_dir(), "quickstart")
    result = _run_train(args, train_dir, _MAX_STEPS)
    self.assertEqual(result.returncode, 0, result.stderr)
    # The banner names the run's train_dir: the README's, in the block.
    readme_dir, = [a.split("=", 1)[1] for a in args
                   if a.startswith("--train_dir=")]
    printed = result.stderr.replace(train_dir, readme_dir).splitlines()
    expected = _first_screen(readme)
    if not any(_ONEDNN.search(line) for line in printed):  # Another CPU.
      expected = [line for line in expected if not _ONEDNN.search(line)]
    self.assertGreaterEqual(len(expected), 3)
    self.assertEqual([_numbers_aside(line) for line in expected],
                     [_numbers_aside(line)
                      for line in printed[:len(expected)]], result.stderr)
    for chatter in _TF_CHATTER:
      self.assertNotIn(chatter, result.stderr)
    self.assertEqual(result.stdout, "")

  def testVerbosityZeroBringsTensorFlowsInfoLinesBack(self):
    result = _run_train(["--batch_size=2", "--num_towers=1", "-v", "0"],
                        os.path.join(self.get_temp_dir(), "verbose"), 1)
    self.assertEqual(result.returncode, 0, result.stderr)
    for chatter in ("Create CheckpointSaverHook", "Graph was finalized",
                    "Saving checkpoints for 1 into"):
      self.assertIn(chatter, result.stderr)


if __name__ == "__main__":
  tf.test.main()
