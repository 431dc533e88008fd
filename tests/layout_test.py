"""The package's folders import one way: core <- inputs <- trainer <- cluster.

A legacy script imports `tf1_safe_train` (core/) only; the trainer
(trainer/, with its inputs data/ and models/) is built on it, and a
cluster's replication (cluster/) on the trainer: its strategies subclass
the trainer's `Local`, and //:train's main module hands one to the runner.
Never the other way round, and no folder imports the binaries' main modules
or cli.py, which sit above all. Checked statically (every import written in
a folder's modules, also those inside functions), and for core also by
importing every core module in a fresh process.

And the sizes that keep the house readable: no function of the package over
60 code lines; modules over 300 lines are named (a warning, not a failure).
"""

import ast
import collections
import os
import subprocess
import sys

import tensorflow as tf

from tests.fixtures import tool_modules
import tf1_safe_train
from tf1_safe_train import core

# The package's folders, lowest first: a module may import its own layer's
# and those below, never one above (docs/layout.md says why). The last
# layer is the binaries' main modules and their flag parsing.
_LAYERS = (
    ("core",),
    ("data", "models"),
    ("trainer",),
    ("cluster",),
    ("cli", "console", "eval", "local_cluster", "replay", "train"),
)
_RANK = {name: rank for rank, layer in enumerate(_LAYERS) for name in layer}
# What importing the core must not load: every layer above it.
_ABOVE_CORE = tuple("tf1_safe_train." + name
                    for layer in _LAYERS[1:] for name in layer)

# One concept per module, each small (the style guide's "under ~300"): a
# warning, not a wall (issue #34): concepts, not the count, decide where
# code goes; the test prints the modules over it.
_MAX_MODULE_LINES = 300

# Modules told apart by a shared first word (checkpoint_*) are a concept
# that wants a folder of its own: at most this many in one folder.
_MAX_SHARED_FIRST_WORD = 3

# Every function of the package reads top to bottom: none over this many
# code lines (`code_lines`).
_MAX_FUNCTION_CODE_LINES = 60
# The decision too (its criteria, one loop): module -> a function of it.
_DECISION = {"core/guard.py": "decide", "core/verdict.py": "with_flags",
             "core/guard_parts.py": "done", "core/criteria.py": "decision",
             "core/reasons.py": "Decision.on_skip"}
# The guard's function (`guard.decide`): at most this many parameters.
_MAX_GUARD_PARAMETERS = 7


def _imported_modules(source):
  """Yields (line, dotted name) of every module or name `source` imports."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        # Relative imports hide the target; the package uses absolute ones.
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


def _rank(target):
  """The layer of the package's module `target` (dotted), or None if it is
  not the package's."""
  parts = target.split(".")
  if parts[0] != "tf1_safe_train":
    return None
  if len(parts) == 1 or parts[1] in tf1_safe_train.__all__:
    return _RANK["core"]  # The package's front: the core's public names.
  # A name the layers do not know ranks above all: place it in _LAYERS.
  return _RANK.get(parts[1], len(_LAYERS))


def offending_imports(source, folder="core"):
  """The imports in `source`, a module of `folder`, against the direction.

  Returns:
    ["line N: dotted.name"] for each import of a layer above `folder`'s
    (old flat-package names resolved) and each relative import.
  """
  bad = []
  for line, name in sorted(_imported_modules(source)):
    rank = _rank(_where_it_goes(name))
    if name.startswith(".") or (rank is not None and rank > _RANK[folder]):
      bad.append("line %d: %s" % (line, name))
  return bad


def _folders():
  """The package's subpackages (folders), by name."""
  directory = os.path.dirname(tf1_safe_train.__file__)
  return sorted(f for f in os.listdir(directory)
                if os.path.isfile(os.path.join(directory, f, "__init__.py")))


def _modules_of(folder):
  """The .py files of `folder` and its subpackages (__init__.py included),
  by path."""
  directory = os.path.join(os.path.dirname(tf1_safe_train.__file__), folder)
  return sorted(os.path.join(d, f) for d, _, files in os.walk(directory)
                for f in files if f.endswith(".py"))


def _package_modules():
  """Every .py file of the package, relative to it (core/guard.py, cli.py)."""
  top = os.path.dirname(tf1_safe_train.__file__)
  return sorted(os.path.relpath(os.path.join(d, f), top)
                for d, _, files in os.walk(top) for f in files
                if f.endswith(".py"))


def crowded_first_words(modules, limit=_MAX_SHARED_FIRST_WORD):
  """["folder: word_* (N modules)"] for each folder of `modules` (paths of
  .py files) holding more than `limit` modules whose names share their
  first word (checkpoint_fit, checkpoint_rollback: "checkpoint")."""
  words = collections.Counter(
      (os.path.dirname(path), os.path.basename(path)[:-3].split("_")[0])
      for path in modules if os.path.basename(path) != "__init__.py")
  return ["%s: %s_* (%d modules)" % (folder or ".", word, n)
          for (folder, word), n in sorted(words.items()) if n > limit]


def map_of(page):
  """The package's folders and modules as docs/layout.md's map draws them.

  The map is the page's first code block; under `tf1_safe_train/` an entry
  is a line whose first words (before two spaces) all end in `.py` or `/`,
  nested by its indentation; other lines continue a description.

  Returns:
    The set of paths relative to the package: "core/", "core/guard.py".
  """
  block = page.split("```")[1].splitlines()
  start = block.index(next(line for line in block
                           if line.startswith("tf1_safe_train/")))
  found = set()
  stack = [(0, "")]  # (indentation, folder path) of the open folders.
  for line in block[start + 1:]:
    indent = len(line) - len(line.lstrip())
    if line.strip() and indent == 0:
      break  # The package's tree ends; the repository's next entry.
    names = line.strip().split("  ")[0].split()
    if not names or not all(n.endswith((".py", "/")) for n in names):
      continue
    while stack[-1][0] >= indent:
      stack.pop()
    for name in names:
      found.add(stack[-1][1] + name)
    if names[-1].endswith("/"):
      stack.append((indent, stack[-1][1] + names[-1]))
  return found


def over_long_modules(lengths, limit=_MAX_MODULE_LINES):
  """["path: N lines"] of the modules in `lengths` ({path: lines}) over
  `limit`."""
  return ["%s: %d lines" % (path, n) for path, n in sorted(lengths.items())
          if n > limit]


def _docstring_lines(tree):
  """The line numbers of every docstring (module, class, function) in
  `tree`."""
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if (isinstance(first, ast.Expr) and
          isinstance(first.value, ast.Constant) and
          isinstance(first.value.value, str)):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def code_lines(source):
  """{function: its code lines} of every function in `source`.

  A function's code lines are the lines from its `def` to its end that are
  neither blank, nor a comment, nor part of a docstring (its own or a
  nested function's); a nested function's lines count for the function
  around it too. Methods are named `Class.method`, nested functions
  `outer.inner`.
  """
  tree = ast.parse(source)
  text = source.splitlines()
  docstrings = _docstring_lines(tree)

  def count(node):
    return sum(1 for n in range(node.lineno, node.end_lineno + 1)
               if n not in docstrings and text[n - 1].strip() and
               not text[n - 1].strip().startswith("#"))

  found = {}

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found[prefix + child.name] = count(child)
        visit(child, prefix + child.name + ".")
      elif isinstance(child, ast.ClassDef):
        visit(child, prefix + child.name + ".")
      else:
        visit(child, prefix)

  visit(tree, "")
  return found


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
        "  from tf1_safe_train.trainer.tower import towers\n"
        "from tf1_safe_train import cluster\n"
        "import tf1_safe_train.cluster.replicas\n"
        "from tf1_safe_train import train_lib\n"
        "from . import guard\n"
        "from tf1_safe_train import SkipNonFiniteOptimizer\n"
        "from tf1_safe_train import data\n"),
                     ["line 4: tf1_safe_train.trainer.tower.towers",
                      "line 5: tf1_safe_train.cluster",
                      "line 6: tf1_safe_train.cluster.replicas",
                      "line 7: tf1_safe_train.train_lib",
                      "line 8: .",
                      "line 10: tf1_safe_train.data"])

  def testTheCheckKnowsTheDirection(self):
    # The trainer may import core and its inputs, never the cluster (also by
    # an old flat-package name) nor a binary's main module.
    source = ("from tf1_safe_train.core import guard\n"
              "from tf1_safe_train import data\n"
              "from tf1_safe_train.trainer.tower import towers\n"
              "from tf1_safe_train.cluster import replication\n"
              "from tf1_safe_train import replicas\n"
              "from tf1_safe_train import cli\n"
              "import tf1_safe_train.train\n"
              "from tf1_safe_train import newfolder\n")
    self.assertEqual(offending_imports(source, "trainer"),
                     ["line 4: tf1_safe_train.cluster.replication",
                      "line 5: tf1_safe_train.replicas",
                      "line 6: tf1_safe_train.cli",
                      "line 7: tf1_safe_train.train",
                      "line 8: tf1_safe_train.newfolder"])
    self.assertEqual(offending_imports(source, "cluster"),
                     ["line 6: tf1_safe_train.cli",
                      "line 7: tf1_safe_train.train",
                      "line 8: tf1_safe_train.newfolder"])

  def testEveryFolderAndMainModuleHasItsLayer(self):
    # A new folder must be placed before its imports can be checked.
    self.assertEqual([f for f in _folders() if f not in _RANK], [])
    directory = os.path.dirname(tf1_safe_train.__file__)
    main_modules = sorted(f[:-3] for f in os.listdir(directory)
                          if f.endswith(".py") and f != "__init__.py")
    self.assertEqual(main_modules, sorted(_LAYERS[-1]))

  def testEveryFolderImportsOnlyItsLayerAndBelow(self):
    folders = _folders()
    self.assertEqual(folders, ["cluster", "core", "data", "models",
                               "trainer"])
    for folder in folders:
      for path in _modules_of(folder):
        with open(path) as f:
          source = f.read()
        with self.subTest(module=os.path.join(folder,
                                              os.path.basename(path))):
          self.assertEqual(offending_imports(source, folder), [])

  def testTheFirstWordCheckCountsPerFolder(self):
    self.assertEqual(crowded_first_words(
        ["trainer/a/checkpoint_x.py", "trainer/a/checkpoint_y.py",
         "trainer/a/checkpoint_z.py", "trainer/a/checkpoints.py",
         "trainer/a/__init__.py", "trainer/b/checkpoint_w.py",
         "core/step_a.py", "core/step_b.py", "core/step.py",
         "core/step_c.py"]),
                     ["core: step_* (4 modules)"])

  def testNoFolderHasMoreThanThreeModulesOfOneFirstWord(self):
    # issue #34: trainer/ held 6 checkpoint*, 5 tower* modules side by side.
    self.assertEqual(crowded_first_words(_package_modules()), [],
                     "give these modules a folder of their own concept")

  def testTheMapParserReadsFoldersAndModules(self):
    self.assertEqual(map_of(
        "x\n```\nWORKSPACE BUILD\ntf1_safe_train/\n"
        "  a.py b.py   the mains\n  core/  the library\n"
        "    guard.py   the guard: see trainer/\n"
        "                 run.py, continued\n"
        "  trainer/   the trainer\n    step/  the step\n"
        "      train_step.py  it\n    run/\n      hooks.py  x\n"
        "  cli.py  flags\ntests/   the tests\n  x.py\n```\n"),
                     {"a.py", "b.py", "core/", "core/guard.py", "trainer/",
                      "trainer/step/", "trainer/step/train_step.py",
                      "trainer/run/", "trainer/run/hooks.py", "cli.py"})

  def testTheLayoutPagesMapMatchesTheFolders(self):
    # The map a reader starts from draws every folder and module where it
    # is (__init__.py aside), and nothing that is not there.
    top = os.path.dirname(tf1_safe_train.__file__)
    with open(os.path.join(os.path.dirname(top), "docs", "layout.md")) as f:
      drawn = map_of(f.read())
    there = set()
    for path in _package_modules():
      folder = os.path.dirname(path)
      while folder:
        there.add(folder + "/")
        folder = os.path.dirname(folder)
      if os.path.basename(path) != "__init__.py":
        there.add(path)
    self.assertEqual(sorted(there - drawn), [], "not in docs/layout.md's map")
    self.assertEqual(sorted(drawn - there - {"__init__.py"}), [],
                     "in docs/layout.md's map, not in the package")

  def testTheLayoutPagesMapIsTheModulesDocstrings(self):
    # The map's lines are generated (tools/module_map.py): each module's
    # line is its docstring's first paragraph, so a new module needs no
    # hand-written line, and a line cannot drift from what the module says.
    top = os.path.dirname(tf1_safe_train.__file__)
    with open(os.path.join(os.path.dirname(top), "docs", "layout.md")) as f:
      page = f.read()
    self.assertMultiLineEqual(
        tool_modules.load("module_map").generate(page, top), page,
        "docs/layout.md's map is not the modules' docstrings: run "
        "`python tools/regen_docs.py` from the repository's top")

  def testTheLengthCheckNamesEachModuleOverTheLimit(self):
    self.assertEqual(
        over_long_modules({"core/a.py": 300, "trainer/b.py": 301,
                           "cli.py": 400}),
        ["cli.py: 400 lines", "trainer/b.py: 301 lines"])

  def testModulesOverThreeHundredLinesAreReportedNotFailed(self):
    # A warning: one concept may need more lines, and a module split only
    # to meet the count scatters its concept.
    top = os.path.dirname(tf1_safe_train.__file__)
    lengths = {}
    for path in _package_modules():
      with open(os.path.join(top, path)) as f:
        lengths[path] = len(f.read().splitlines())
    self.assertIn("trainer/run/train_lib.py", lengths)
    for line in over_long_modules(lengths):
      print("layout_test: warning: module over %d lines (one concept?): %s"
            % (_MAX_MODULE_LINES, line))

  def testCodeLinesCountNeitherBlanksNorCommentsNorDocstrings(self):
    self.assertEqual(code_lines(
        "def f(a,\n"
        "      b):\n"
        '  """Doc.\n'
        "\n"
        '  More."""\n'
        "  # A comment.\n"
        "\n"
        "  def g():\n"
        '    """Doc."""\n'
        '    return """a\n'
        "\n"
        'b"""\n'
        "  return g\n"
        "class C(object):\n"
        '  """Doc."""\n'
        "  def m(self):\n"
        "    pass\n"),
                     {"f": 6, "f.g": 3, "C.m": 2})

  def testNoFunctionIsOverSixtyCodeLines(self):
    top = os.path.dirname(tf1_safe_train.__file__)
    long_ones = []
    seen = set()
    for path in _package_modules():
      with open(os.path.join(top, path)) as f:
        lengths = code_lines(f.read())
      for function, n in sorted(lengths.items()):
        seen.add("%s:%s" % (path, function))
        if n > _MAX_FUNCTION_CODE_LINES:
          long_ones.append("%s:%s: %d code lines" % (path, function, n))
    self.assertIn("trainer/run/train_lib.py:train", seen)
    self.assertEqual(long_ones, [], "split these functions by concept")

  def testNoFunctionOfTheDecisionIsOverSixtyCodeLines(self):
    top = os.path.dirname(tf1_safe_train.__file__)
    long_ones = []
    for path, function in sorted(_DECISION.items()):
      with open(os.path.join(top, path)) as f:
        lengths = code_lines(f.read())
      self.assertIn(function, lengths)
      long_ones += ["%s:%s: %d code lines" % (path, name, n)
                    for name, n in sorted(lengths.items())
                    if n > _MAX_FUNCTION_CODE_LINES]
    self.assertEqual(long_ones, [], "split these functions by concept")

  def testTheGuardsFunctionTakesFewParameters(self):
    # Every reason to skip and every part of the decision is a criterion
    # (`guard_parts`): none plugs in by a parameter of its own.
    from tf1_safe_train.core import guard  # pylint: disable=g-import-not-at-top
    code = guard.decide.__code__
    self.assertLessEqual(code.co_argcount + code.co_kwonlyargcount,
                         _MAX_GUARD_PARAMETERS)

  def testImportingTheCoreLoadsNothingAboveIt(self):
    # A fresh process: this one may have imported anything already. Also the
    # public names a legacy script uses, which load core modules lazily.
    script = "\n".join(
        ["import sys", "import tf1_safe_train"] +
        ["import tf1_safe_train.core.%s" % m for m in _core_modules()] +
        ["tf1_safe_train.%s" % name for name in tf1_safe_train.__all__] +
        ["print(sorted(m for m in sys.modules if m.startswith(%r)))"
         % (_ABOVE_CORE,)])
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
