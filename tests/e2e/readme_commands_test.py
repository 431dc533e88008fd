"""Every command in the README runs, and the README is a short front door.

Each line of a ```sh block of README.md is a command (issue 37). The test
runs them in the README's order, as a user would: `./bazelw run //:NAME --
ARGS` runs binary NAME with ARGS (tests/fixtures/binaries.py: under `bazel test` the
same Bazel-built binary `./bazelw run` runs, which cannot itself run inside
Bazel's test sandbox; elsewhere its main module), with every path under
/tmp/ moved into the test's temporary directory (the same run, in a
directory of its own); `//:tensorboard`, which serves until stopped, runs
until it answers on a free port of 127.0.0.1 (the README's: 6006). The
commands that cannot run in a test are listed in `_NOT_RUN` with the
reason, so that a command added to the README fails
`testEveryCommandRunsOrIsListed` until it is run here or listed.

The first command, the quick start, runs once for two of the README's
promises: a fresh process in the user's environment (TensorFlow's log
level unset), whose first lines must be the README's first-screen block
and whose last line its last-line block, numbers aside (times, ids,
losses, rates) and the README's --train_dir in place of the test's, with
no INFO line or deprecation notice of TensorFlow in between.
"""

import re
import subprocess
import urllib.request

import tensorflow as tf

from tests.fixtures import binaries
from tests.fixtures import readme_text
from tests.fixtures import tensorboard_server

_MAX_LINES = 250
# Commands of the README that no test can run, and why.
_NOT_RUN = {
    "./bazelw test //...":
        "runs this very suite: Bazel cannot run inside a Bazel test's "
        "sandbox (.ci/run runs it)",
    "pip install /path/to/tf1_safe_train":
        "pip's isolated build fetches its build backend from the network; "
        "tests/e2e/pip_install_test.py builds the wheel offline and installs it "
        "(--no-deps) into a fresh virtualenv",
    "pip install --no-deps tf-keras==2.21.0":
        "downloads from PyPI; ./bazelw runs the same install "
        "(requirements-legacy.txt), as tests/e2e/pip_install_test.py checks",
}
# The targets `./bazelw run` runs in the README, as tests/fixtures/binaries.py names
# them (tensorboard aside: `_serve`).
_BINARIES = {"train", "eval", "replay", "local_cluster", "tensorboard"}
_WAIT_SECS = 120
# TensorFlow's INFO lines and deprecation notices (logged as warnings),
# which the quick start must not print.
_TF_CHATTER = ("Create CheckpointSaverHook", "Graph was finalized",
               "local_init_op", "Calling checkpoint listeners",
               "Saving checkpoints for", "is deprecated")
# TensorFlow's oneDNN notice, printed only on CPUs where it turns oneDNN on.
_ONEDNN = re.compile(r"oneDNN custom operations|before absl::InitializeLog")


def commands(text):
  return readme_text.commands(text)


def bazel_run(command):
  return readme_text.bazel_run(command, _BINARIES)


def _in(directory, args):
  """`args` with each path under /tmp/ moved into `directory`."""
  return [re.sub(r"(?<![\w/])/tmp/", directory.rstrip("/") + "/", a)
          for a in args]


class ReadmeCommandsTest(tf.test.TestCase):

  def testTheReadmeIsAShortFrontDoor(self):
    self.assertLessEqual(len(readme_text.readme().splitlines()), _MAX_LINES)

  def testEveryCommandRunsOrIsListed(self):
    found = commands(readme_text.readme())
    self.assertIn("./bazelw test //...", found)
    for command in found:
      with self.subTest(command=command):
        self.assertTrue(command in _NOT_RUN or bazel_run(command),
                        "run it in testEveryCommandRunsInOrder, or list it "
                        "in _NOT_RUN with the reason")
    # A command the README no longer shows is no longer excused.
    self.assertEqual([c for c in _NOT_RUN if c not in found], [])

  def testTheCommandParserReadsBlocksAndTargets(self):
    self.assertEqual(commands("x\n```sh\na b \\\n  c\n# no\n```\n```\nd\n```"
                              "\n```sh\ne\n```\n"), ["a b c", "e"])
    self.assertEqual(bazel_run("./bazelw run //:train -- --a=1 '--b=x y'"),
                     ("train", ["--a=1", "--b=x y"]))
    self.assertIsNone(bazel_run("./bazelw run //:nothing -- --a=1"))
    self.assertIsNone(bazel_run("pip install x"))
    self.assertEqual(_in("/t/d", ["--logdir=/tmp/q", "--x=/var/tmp/y"]),
                     ["--logdir=/t/d/q", "--x=/var/tmp/y"])

  def testEveryCommandRunsInOrder(self):
    readme = readme_text.readme()
    work = self.get_temp_dir()
    ran = []
    for command in commands(readme):
      if command in _NOT_RUN:
        continue
      name, args = bazel_run(command)
      args = _in(work, args)
      with self.subTest(command=command):
        if name == "tensorboard":
          self._serve(args)
        else:
          quick_start = not ran
          result = (_run_as_user(name, args) if quick_start else
                    binaries.run(name, *args, timeout=900,
                                 fresh_process=name == "local_cluster"))
          self.assertEqual(result.returncode, 0, result.stderr[-5000:])
          if quick_start:
            self._assertFirstScreen(readme, command, result, work)
            self._assertLastLine(readme, result.stderr, work)
        ran.append(name)
    self.assertEqual(ran[0], "train")
    self.assertContainsSubset(_BINARIES, ran)

  def _assertFirstScreen(self, readme, command, result, work):
    """The run's first lines are the README's first screen, no chatter."""
    # The banner names the run's train_dir: the README's, in the block.
    printed = result.stderr.replace(work.rstrip("/") + "/",
                                    "/tmp/").splitlines()
    expected = readme_text.first_screen(readme)
    if not any(_ONEDNN.search(line) for line in printed):  # Another CPU.
      expected = [line for line in expected if not _ONEDNN.search(line)]
    self.assertGreaterEqual(len(expected), 3)
    self.assertIn("--train_dir=/tmp/", command)
    self.assertEqual([readme_text.numbers_aside(line) for line in expected],
                     [readme_text.numbers_aside(line)
                      for line in printed[:len(expected)]], result.stderr)
    for chatter in _TF_CHATTER:
      self.assertNotIn(chatter, result.stderr)
    self.assertEqual(result.stdout, "")

  def _assertLastLine(self, readme, stderr, work):
    expected = readme_text.last_line(readme)
    last = stderr.strip().splitlines()[-1].replace(work.rstrip("/") + "/",
                                                   "/tmp/")
    self.assertEqual(readme_text.numbers_aside(expected),
                     readme_text.numbers_aside(last))

  def _serve(self, args):
    """Runs TensorBoard with `args` on a free port until it answers."""
    process = tensorboard_server.start(args)
    try:
      port, output = tensorboard_server.port(process, _WAIT_SECS)
      if port is None:
        self.fail("TensorBoard did not start (exit code %s):\n%s" % (
            process.poll(), output))
      url = "http://127.0.0.1:%d/data/runs" % port
      with urllib.request.urlopen(url, timeout=30) as response:
        self.assertEqual(response.status, 200)
    finally:
      process.kill()
      process.wait(timeout=30)
      process.stdout.close()


def _run_as_user(name, args):
  """Runs binary `name` as a new process in the user's environment: the
  binaries' own log level (not the tests' quiet one), so TensorFlow's
  start-up lines are the user's."""
  env = binaries.env()
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  return subprocess.run(binaries.command(name) + list(args),
                        capture_output=True, text=True, env=env,
                        timeout=900, check=False)


if __name__ == "__main__":
  tf.test.main()
