"""The core library imports nothing of the trainer or its replication.

A legacy script imports `tf1_safe_train` (core/) only; the trainer
(trainer/) and its replication (cluster/) are built on it, never the other
way round. Checked twice: statically (every import written in core/, also
those inside functions) and by importing every core module in a fresh
process.
"""

import ast
import os
import subprocess
import sys

import tensorflow as tf

import tf1_safe_train
from tf1_safe_train import core

_FORBIDDEN = ("tf1_safe_train.trainer", "tf1_safe_train.cluster")


def _imported_modules(source):
  """Yields (line, dotted name) of every module or name `source` imports."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        # Relative imports hide the target; core uses absolute ones only.
        yield node.lineno, "." * node.level + (node.module or "")
        continue
      for alias in node.names:
        yield node.lineno, "%s.%s" % (node.module, alias.name)


def _where_it_goes(name):
  """`name` with an old flat-package name (tf1_safe_train.towers) resolved."""
  parts = name.split(".")
  if parts[0] == "tf1_safe_train" and len(parts) > 1:
    moved = tf1_safe_train._MOVED.get(parts[1])  # pylint: disable=protected-access
    if moved:
      return ".".join([moved] + parts[2:])
  return name


def offending_imports(source):
  """The imports in `source` that reach the trainer or cluster subpackages."""
  bad = []
  for line, name in sorted(_imported_modules(source)):
    target = _where_it_goes(name)
    if name.startswith(".") or any(
        target == p or target.startswith(p + ".") for p in _FORBIDDEN):
      bad.append("line %d: %s" % (line, name))
  return bad


def _core_modules():
  directory = os.path.dirname(core.__file__)
  return sorted(f[:-3] for f in os.listdir(directory)
                if f.endswith(".py") and f != "__init__.py")


class LayoutTest(tf.test.TestCase):

  def testTheCheckFindsWhatItLooksFor(self):
    self.assertEqual(offending_imports(
        "from tf1_safe_train.core import guard\n"
        "import tensorflow as tf\n"
        "def f():\n"
        "  from tf1_safe_train.trainer import towers\n"
        "from tf1_safe_train import cluster\n"
        "import tf1_safe_train.cluster.replicas\n"
        "from tf1_safe_train import train_lib\n"
        "from . import guard\n"),
                     ["line 4: tf1_safe_train.trainer.towers",
                      "line 5: tf1_safe_train.cluster",
                      "line 6: tf1_safe_train.cluster.replicas",
                      "line 7: tf1_safe_train.train_lib",
                      "line 8: ."])

  def testCoreSourcesImportNothingOfTheTrainer(self):
    directory = os.path.dirname(core.__file__)
    modules = _core_modules()
    self.assertIn("optimizer", modules)
    self.assertIn("guard", modules)
    for module in modules:
      with open(os.path.join(directory, module + ".py")) as f:
        source = f.read()
      with self.subTest(module=module):
        self.assertEqual(offending_imports(source), [])

  def testImportingTheCoreLoadsNothingOfTheTrainer(self):
    # A fresh process: this one may have imported anything already. Also the
    # public names a legacy script uses, which load core modules lazily.
    script = "\n".join(
        ["import sys", "import tf1_safe_train"] +
        ["import tf1_safe_train.core.%s" % m for m in _core_modules()] +
        ["tf1_safe_train.%s" % name for name in tf1_safe_train.__all__] +
        ["print(sorted(m for m in sys.modules if m.startswith(%r)))"
         % (_FORBIDDEN,)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
               TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip().splitlines()[-1], "[]")

  def testOldModuleNamesStillResolve(self):
    # Code written for the flat package: `from tf1_safe_train import
    # loss_scale`, `tf1_safe_train.optimizer.SkipNonFiniteOptimizer`. (The
    # test's BUILD target depends on every module, so that each is there.)
    from tf1_safe_train import loss_scale  # pylint: disable=g-import-not-at-top
    self.assertEqual(loss_scale.__name__, "tf1_safe_train.core.loss_scale")
    self.assertIs(tf1_safe_train.optimizer.SkipNonFiniteOptimizer,
                  tf1_safe_train.SkipNonFiniteOptimizer)
    for old, new in tf1_safe_train._MOVED.items():  # pylint: disable=protected-access
      with self.subTest(old=old):
        self.assertTrue(os.path.exists(os.path.join(
            os.path.dirname(tf1_safe_train.__file__),
            *new.split(".")[1:]) + ".py"), new)


if __name__ == "__main__":
  tf.test.main()
