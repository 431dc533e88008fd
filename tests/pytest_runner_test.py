"""tools/pytest_runner.py: Bazel's sharding maps onto pytest's selection."""

import os
import re
import subprocess
import sys
import tempfile
import unittest

_TESTS = """
import unittest

class A(unittest.TestCase):
%s
"""


def _runner():
  root = os.environ.get("TEST_SRCDIR")
  if root:
    root = os.path.join(root, os.environ["TEST_WORKSPACE"])
  else:
    root = os.path.join(os.path.dirname(__file__), os.pardir)
  return os.path.join(root, "tools", "pytest_runner.py")


class ShardTest(unittest.TestCase):

  def _run(self, directory, shard_env):
    """Runs the runner on five tests that print their names; returns them."""
    path = os.path.join(directory, "five_test.py")
    with open(path, "w") as f:
      f.write(_TESTS % "".join(
          "  def test%d(self):\n    print('ran %d')\n" % (i, i)
          for i in range(5)))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TEST_SHARD", "TEST_TOTAL", "TESTBRIDGE",
                                "XML_OUTPUT"))}
    env.update(shard_env)
    result = subprocess.run(
        [sys.executable, _runner(), path, "-s"],
        capture_output=True, text=True, env=env, cwd=directory,
        timeout=120, check=False)
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    # Printed between pytest's progress dots.
    return sorted(int(n) for n in re.findall(r"ran (\d+)", result.stdout))

  def testEachShardRunsItsShareAndTogetherAll(self):
    directory = tempfile.mkdtemp()
    ran = []
    for index in range(3):
      status = os.path.join(directory, "status%d" % index)
      mine = self._run(directory, {"TEST_TOTAL_SHARDS": "3",
                                   "TEST_SHARD_INDEX": str(index),
                                   "TEST_SHARD_STATUS_FILE": status})
      self.assertEqual(mine, list(range(index, 5, 3)))
      self.assertTrue(os.path.exists(status))  # Bazel: "this runner shards".
      ran += mine
    self.assertEqual(sorted(ran), list(range(5)))
    self.assertEqual(self._run(directory, {}), list(range(5)))

  def testAShardWithoutTestsPasses(self):
    directory = tempfile.mkdtemp()
    self.assertEqual(self._run(directory, {"TEST_TOTAL_SHARDS": "7",
                                           "TEST_SHARD_INDEX": "6"}), [])


if __name__ == "__main__":
  unittest.main()
