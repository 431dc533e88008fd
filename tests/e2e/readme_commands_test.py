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
"""

import os
import re
import shlex
import urllib.request

import tensorflow as tf

from tests.fixtures import binaries
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


def _root():
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    return os.path.join(srcdir, os.environ["TEST_WORKSPACE"])
  return os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)


def _readme():
  with open(os.path.join(_root(), "README.md")) as f:
    return f.read()


def commands(text):
  """The commands of the ```sh blocks of `text`, in order (a line ending
  in a backslash goes on on the next)."""
  found = []
  for block in re.findall(r"(?ms)^```sh\n(.*?)^```", text):
    for line in block.replace("\\\n", " ").splitlines():
      line = " ".join(line.split())
      if line and not line.startswith("#"):
        found.append(line)
  return found


def bazel_run(command):
  """(target name, its arguments) of `./bazelw run //:NAME -- ARGS`, or
  None for another command."""
  words = shlex.split(command)
  if words[:2] != ["./bazelw", "run"] or len(words) < 3:
    return None
  match = re.match(r"^//:(\w+)$", words[2])
  if not match or match.group(1) not in _BINARIES:
    return None
  args = words[3:]
  if args and args[0] == "--":
    args = args[1:]
  return match.group(1), args


def _in(directory, args):
  """`args` with each path under /tmp/ moved into `directory`."""
  return [re.sub(r"(?<![\w/])/tmp/", directory.rstrip("/") + "/", a)
          for a in args]


def _numbers_aside(line):
  """`line` with each number a '#' (tests/e2e/first_screen_test.py's)."""
  return re.sub(r" +", " ", re.sub(r"\d+", "#", line))


class ReadmeCommandsTest(tf.test.TestCase):

  def testTheReadmeIsAShortFrontDoor(self):
    self.assertLessEqual(len(_readme().splitlines()), _MAX_LINES)

  def testEveryCommandRunsOrIsListed(self):
    found = commands(_readme())
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
    readme = _readme()
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
          result = binaries.run(name, *args, timeout=900,
                                fresh_process=name == "local_cluster")
          self.assertEqual(result.returncode, 0, result.stderr[-5000:])
          if not ran:  # The quick start: its last line is the README's.
            self._assertLastLine(readme, result.stderr, work)
        ran.append(name)
    self.assertEqual(ran[0], "train")
    self.assertContainsSubset(_BINARIES, ran)

  def _assertLastLine(self, readme, stderr, work):
    expected = re.search(r"<!-- last-line[^>]*-->\n```\n(.*)\n```",
                         readme).group(1)
    last = stderr.strip().splitlines()[-1].replace(work.rstrip("/") + "/",
                                                   "/tmp/")
    self.assertEqual(_numbers_aside(expected), _numbers_aside(last))

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


if __name__ == "__main__":
  tf.test.main()
