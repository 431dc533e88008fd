"""The test files of a folder share a process (docs/layout.md, "Adding a
test"): what one leaves behind, the next sees. Checked statically:

- no test file trains in a fixed name under the process's temporary folder
  (`tf1.test.get_temp_dir()` is one per process, shared by every file of a
  shard: two classes' "fp16" runs would resume each other's checkpoints);
  a class takes a folder of its own (`tempfile.mkdtemp(dir=...)`), a test
  `self.get_temp_dir()`;
- no two test files share a name (pytest imports them by it, and
  tests/shard_costs.json keys their costs by it).
"""

import collections
import os
import re
import unittest

_TESTS = os.path.dirname(os.path.abspath(__file__))

# `tf1.test.get_temp_dir()` (or tf.compat.v1's) joined with a fixed name,
# or named as a folder to join names with.
_SHARED_TEMP = re.compile(
    r"(?:tf1|tf\.compat\.v1)\.test\.get_temp_dir\(\),\s*[\"']|"
    r"= *(?:tf1|tf\.compat\.v1)\.test\.get_temp_dir\(\) *$", re.M)


def _test_files():
  for folder, _, files in os.walk(_TESTS):
    for name in files:
      if name.endswith("_test.py"):
        yield os.path.join(folder, name)


def shared_temp_names(source):
  """The lines of `source` that join the process's temporary folder with a
  fixed name."""
  return [source.count("\n", 0, m.start()) + 1
          for m in _SHARED_TEMP.finditer(source)]


class SharedProcessTest(unittest.TestCase):

  def testTheCheckFindsAFixedNameInTheProcesssTemporaryFolder(self):
    self.assertEqual(shared_temp_names(
        'a = 1\nd = os.path.join(tf1.test.get_temp_dir(), "fp16")\n'), [2])
    self.assertEqual(shared_temp_names(
        "d = os.path.join(tf.compat.v1.test.get_temp_dir(),\n 'x')\n"), [1])
    self.assertEqual(shared_temp_names(
        "d = tempfile.mkdtemp(dir=tf1.test.get_temp_dir())\n"
        "e = os.path.join(self.get_temp_dir(), 'run')\n"), [])
    self.assertEqual(shared_temp_names(
        "x = 1\nroot = tf1.test.get_temp_dir()\n"), [2])

  def testNoTestFileUsesAFixedNameInTheProcesssTemporaryFolder(self):
    for path in sorted(_test_files()):
      if path == os.path.abspath(__file__):
        continue  # Its own cases.
      with open(path) as f:
        source = f.read()
      with self.subTest(path=os.path.relpath(path, _TESTS)):
        self.assertEqual(shared_temp_names(source), [])

  def testNoTwoTestFilesShareAName(self):
    by_name = collections.defaultdict(list)
    for path in _test_files():
      by_name[os.path.basename(path)].append(os.path.relpath(path, _TESTS))
    self.assertEqual({n: p for n, p in by_name.items() if len(p) > 1}, {})


if __name__ == "__main__":
  unittest.main()
