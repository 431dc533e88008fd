"""tools/pytest_runner.py: Bazel's sharding maps onto pytest's selection."""

import importlib.util
import json
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
    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
  return os.path.join(root, "tools", "pytest_runner.py")


def _load_runner():
  spec = importlib.util.spec_from_file_location("pytest_runner", _runner())
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


pytest_runner = _load_runner()


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


class FileShardTest(unittest.TestCase):
  """A folder's target: several files, shared out whole, by recorded cost."""

  def _run(self, directory, costs, index, total):
    names = {"slow_test.py": 2, "quick_test.py": 2, "new_test.py": 1}
    paths = []
    for name, tests in sorted(names.items()):
      paths.append(os.path.join(directory, name))
      with open(paths[-1], "w") as f:
        f.write(_TESTS % "".join(
            "  def test%d(self):\n    print('ran %s %d')\n" % (i, name, i)
            for i in range(tests)))
    costs_file = os.path.join(directory, "costs.json")
    with open(costs_file, "w") as f:
      json.dump(costs, f)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TEST_SHARD", "TEST_TOTAL", "TESTBRIDGE",
                                "XML_OUTPUT"))}
    env.update(TEST_TOTAL_SHARDS=str(total), TEST_SHARD_INDEX=str(index))
    result = subprocess.run(
        [sys.executable, _runner(), "--costs=" + costs_file] + paths + ["-s"],
        capture_output=True, text=True, env=env, cwd=directory,
        timeout=120, check=False)
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    return sorted(re.findall(r"ran (\w+_test.py \d+)", result.stdout))

  def testEachFileRunsWholeInOneShardTheCostliestAlone(self):
    directory = tempfile.mkdtemp()
    # new_test.py is in no table: it costs the table's lower median, 1.
    costs = {"slow_test.py": 100, "quick_test.py": 1}
    first = self._run(directory, costs, 0, 2)
    second = self._run(directory, costs, 1, 2)
    self.assertEqual(first, ["slow_test.py 0", "slow_test.py 1"])
    self.assertEqual(second, ["new_test.py 0", "quick_test.py 0",
                              "quick_test.py 1"])

  def testTheSplitBalancesTheCosts(self):
    shares = pytest_runner.shard_files(
        {"a": 50, "b": 40, "c": 30, "d": 20, "e": 10}, 3)
    self.assertEqual(shares, [["a"], ["b", "e"], ["c", "d"]])


# A test file whose module registers an exit handler and holds an object
# that says when Python's finalization destroys it.
_ENDING = """
import atexit
import sys
import unittest

atexit.register(lambda: print("exit handler ran", flush=True))


class Finalized(object):
  def __del__(self):
    sys.__stdout__.write("finalized\\n")
    sys.__stdout__.flush()


KEPT = Finalized()


class A(unittest.TestCase):
  def test(self):
    self.assertTrue(%s)
"""


class ExitTest(unittest.TestCase):

  def _end(self, passes):
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "ending_test.py")
    with open(path, "w") as f:
      f.write(_ENDING % passes)
    xml = os.path.join(directory, "test.xml")
    env = dict(os.environ, XML_OUTPUT_FILE=xml)
    result = subprocess.run(
        [sys.executable, _runner(), path], capture_output=True, text=True,
        env=env, cwd=directory, timeout=120, check=False)
    with open(xml) as f:
      return result, f.read()

  # The runner ends its process without Python's finalization (TensorFlow's
  # teardown: about 0.8 CPU s a test), after the exit handlers and with the
  # report, the JUnit XML and the exit code as pytest left them.
  def testEndsWithoutFinalizationAfterTheExitHandlers(self):
    for passes, code in (("True", 0), ("False", 1)):
      result, xml = self._end(passes)
      self.assertEqual(result.returncode, code, result.stdout + result.stderr)
      self.assertIn("exit handler ran", result.stdout)
      self.assertNotIn("finalized", result.stdout)
      self.assertIn("1 %s" % ("passed" if code == 0 else "failed"),
                    result.stdout)
      self.assertIn('tests="1"', xml)
      self.assertIn('failures="%d"' % code, xml)


if __name__ == "__main__":
  unittest.main()
