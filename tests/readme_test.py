"""The README's promises that a test can check: its example runs as written."""

import importlib
import os
import re
import subprocess
import sys

import tensorflow as tf


def _readme():
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    path = os.path.join(srcdir, os.environ["TEST_WORKSPACE"], "README.md")
  else:
    path = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
  with open(path) as f:
    return f.read()


def _example():
  """The python block that follows the readme-example marker."""
  match = re.search(r"<!-- readme-example[^>]*-->\s*```python\n(.*?)```",
                    _readme(), re.S)
  return match.group(1) if match else None


def _runnable_blocks():
  """(expected outputs, code) of each python block after a readme-run marker."""
  blocks = []
  for match in re.finditer(
      r"<!-- readme-run: expect ((?:\"[^\"]*\"\s*)+)-->\s*```python\n(.*?)```",
      _readme(), re.S):
    blocks.append((re.findall(r'"([^"]*)"', match.group(1)), match.group(2)))
  return blocks


def _run(code, cwd):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join(sys.path))
  return subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, env=env, timeout=300, check=False, cwd=cwd)


class ReadmeTest(tf.test.TestCase):

  def testExampleRunsAsWritten(self):
    code = _example()
    self.assertIsNotNone(code, "no readme-example block in README.md")
    self.assertLessEqual(len(code.strip().splitlines()), 40)
    result = _run(code, self.get_temp_dir())
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("global_step 5 applied 4 skipped 1 finite True",
                  result.stdout)

  def testEveryRunnableBlockRunsAsWritten(self):
    blocks = _runnable_blocks()
    self.assertGreaterEqual(len(blocks), 3)
    for expected, code in blocks:
      with self.subTest(expected[0]):
        self.assertLessEqual(len(code.strip().splitlines()), 40)
        result = _run(code, self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr)
        for line in expected:
          self.assertIn(line, result.stdout + result.stderr)

  def testEveryNameOfThePackageItMentionsExists(self):
    names = sorted(set(re.findall(r"\btf1_safe_train((?:\.[A-Za-z_]\w*)+)",
                                  _readme())))
    self.assertIn(".GiveUpHook", names)
    for name in names:
      parts = name.lstrip(".").split(".")
      value = importlib.import_module("tf1_safe_train")
      for i, part in enumerate(parts):
        if not hasattr(value, part):
          # A submodule not imported yet, e.g. tf1_safe_train.guard.
          importlib.import_module(".".join(["tf1_safe_train"] + parts[:i + 1]))
        value = getattr(value, part)
      self.assertTrue(callable(value), name)

  def testQuickStartCommandsAreThere(self):
    readme = _readme()
    self.assertIn("./bazelw run //:train -- ", readme)
    self.assertIn("./bazelw test //...", readme)


if __name__ == "__main__":
  tf.test.main()
