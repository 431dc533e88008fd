"""The README's and docs' promises that a test can check.

README.md and every docs/*.md page: each python block after a readme-run
marker runs as written, every `tf1_safe_train.<name>`, Bazel target and file
they mention exists, each generated flags table equals the one the flag
declarations give (and those are the flags the binary defines), and the
README's list of idioms names the rows of docs/wrapper.md's idioms table
with their verdicts.
"""

import glob
import importlib
import importlib.util
import json
import os
import re
import sys

import tensorflow as tf

from tests.fixtures import forked_python
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.config import params as params_lib

_FLAG_SPECS = {
    "train": (flag_specs.of_params(params_lib.TrainParams) +
              cluster_flags.FLAGS),
    "eval": flag_specs.of_params(params_lib.EvalParams),
}
# Prints {flag: [default, help, enum values]} of the flags a binary defines.
_DUMP_FLAGS = """
import json, sys
from absl import flags
import tf1_safe_train.{0}
print(json.dumps({{f.name: [f.default, f.help,
                            getattr(f.parser, "enum_values", None)]
                  for f in flags.FLAGS.get_flags_for_module(
                      "tf1_safe_train.{0}")}}))
"""


def _root():
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    return os.path.join(srcdir, os.environ["TEST_WORKSPACE"])
  return os.path.join(os.path.dirname(__file__), os.pardir)


def _read(page, root=None):
  with open(os.path.join(root or _root(), page)) as f:
    return f.read()


def _source_root():
  """The repository itself, where every file and BUILD file is.

  Under Bazel the runfiles hold only this test's inputs; README.md there is
  a link into the source tree.
  """
  return os.path.dirname(os.path.realpath(os.path.join(_root(), "README.md")))


def _pages():
  """README.md and the docs pages, as paths relative to the repository."""
  docs = sorted(os.path.relpath(p, _root())
                for p in glob.glob(os.path.join(_root(), "docs", "*.md")))
  return ["README.md"] + docs


def _readme():
  return _read("README.md")


def _example():
  """The python block that follows the readme-example marker."""
  match = re.search(r"<!-- readme-example[^>]*-->\s*```python\n(.*?)```",
                    _readme(), re.S)
  return match.group(1) if match else None


def _runnable_blocks(text):
  """(expected outputs, code) of each python block after a readme-run marker."""
  blocks = []
  for match in re.finditer(
      r"<!-- readme-run: expect ((?:\"[^\"]*\"\s*)+)-->\s*```python\n(.*?)```",
      text, re.S):
    blocks.append((re.findall(r'"([^"]*)"', match.group(1)), match.group(2)))
  return blocks


def _flags_tables(text):
  """{binary: the table} of each flags-table marker of `text`."""
  return dict(re.findall(
      r"<!-- flags-table: (\w+) -->\n(.*?)<!-- /flags-table -->", text, re.S))


def _consumer_copy_line(text):
  """The files the `cp` line after the consumer-files marker copies."""
  match = re.search(r"<!-- consumer-files -->\s*```sh\n(?:.*\n)*?\s*cp (.*) \S+\n",
                    text)
  return match.group(1).split() if match else None


def _words(text):
  return " ".join(text.split())


def idioms_table(text):
  """{name: verdict} of the idioms table after the idioms-table marker.

  Each row is `| **name**: how | **verdict**: what the one line does | ... |`;
  a row not so written maps its first cell to None (so it cannot be missed).
  """
  match = re.search(r"<!-- idioms-table[^>]*-->\n(?:\|.*\n)+", text)
  found = {}
  for row in (match.group(0).splitlines()[3:] if match else []):
    cells = re.match(r"\| \*\*(.+?)\*\*:[^|]*\| \*\*(.+?)\*\*", row)
    if cells:
      found[_words(cells.group(1))] = _words(cells.group(2))
    else:
      found[_words(row.split("|")[1])] = None
  return found


def idioms_list(text):
  """{name: verdict} of the list between the idioms markers.

  Each item is `- **verdict**: name; name; name.`, the names ending at the
  first period followed by a space (prose may follow).
  """
  match = re.search(r"<!-- idioms:[^>]*-->\n(.*?)<!-- /idioms -->", text,
                    re.S)
  found = {}
  for verdict, body in re.findall(r"(?ms)^- \*\*(.+?)\*\*: (.*?)(?=^- |\Z)",
                                  match.group(1) if match else ""):
    names = re.split(r"\.(?:\s|$)", _words(body), maxsplit=1)[0]
    for name in names.split(";"):
      found[_words(name)] = _words(verdict)
  return found


def _run(code, cwd):
  """Runs `code` as `python -c` would, in a process of its own.

  The process is forked from one that imported TensorFlow once
  (forked_python), not started anew: a fresh `__main__`, no state of
  another block's.
  """
  return forked_python.run_shared(code, cwd)


def tearDownModule():
  forked_python.close_shared()


def _folder_targets(package, build):
  """The test targets `py_pytest_folders` (tools/pytest.bzl) declares in
  `package`: FOLDER_tests for each folder holding a *_test.py file (in it or
  below), and its top_name for the package's own."""
  call = re.search(r"^py_pytest_folders\((.*?)^\)", build, re.S | re.M)
  if not call:
    return set()
  top = re.search(r'top_name = "(\w+)"', call.group(1)).group(1)
  base = os.path.join(_source_root(), package)
  names = set()
  for folder, _, files in os.walk(base):
    if any(name.endswith("_test.py") for name in files):
      relative = os.path.relpath(folder, base)
      names.add(top if relative == "." else
                relative.split(os.sep)[0] + "_tests")
  return names


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
    count = 0
    for page in _pages():
      for expected, code in _runnable_blocks(_read(page)):
        count += 1
        with self.subTest(page=page, expect=expected[0]):
          self.assertLessEqual(len(code.strip().splitlines()), 40)
          result = _run(code, self.get_temp_dir())
          self.assertEqual(result.returncode, 0, result.stderr)
          for line in expected:
            self.assertIn(line, result.stdout + result.stderr)
    self.assertGreaterEqual(count, 3)

  def testEveryNameOfThePackageItMentionsExists(self):
    names = set()
    for page in _pages():
      names.update((page, name) for name in re.findall(
          r"(?<!-m )\btf1_safe_train((?:\.[A-Za-z_]\w*)+)", _read(page)))
    self.assertIn(".GiveUpHook", {name for _, name in names})
    for page, name in sorted(names):
      with self.subTest(page=page, name=name):
        parts = name.lstrip(".").split(".")
        value = importlib.import_module("tf1_safe_train")
        for i, part in enumerate(parts):
          if not hasattr(value, part):
            # A submodule not imported yet, e.g. tf1_safe_train.core.guard.
            importlib.import_module(
                ".".join(["tf1_safe_train"] + parts[:i + 1]))
          value = getattr(value, part)
        self.assertTrue(callable(value), name)

  def testEveryModuleItRunsWithPythonMExists(self):
    # `python -m tf1_safe_train.train`: a main module (found, not imported:
    # the binaries' modules define their flags when imported).
    modules = set()
    for page in _pages():
      modules.update((page, name) for name in re.findall(
          r"python -m (tf1_safe_train(?:\.\w+)+)", _read(page)))
    self.assertIn(("README.md", "tf1_safe_train.train"), modules)
    for page, module in sorted(modules):
      with self.subTest(page=page, module=module):
        spec = importlib.util.find_spec(module)
        self.assertIsNotNone(spec, module)
        with open(spec.origin) as f:
          self.assertIn('if __name__ == "__main__":', f.read())

  def testQuickStartCommandsAreThere(self):
    readme = _readme()
    self.assertIn("./bazelw run //:train -- ", readme)
    self.assertIn("./bazelw test //...", readme)

  def testEveryBazelTargetItRunsExists(self):
    for page in _pages():
      for package, name in sorted(set(re.findall(
          r"//([\w/]*):(\w+)", _read(page)))):
        if name == "all":
          continue
        with self.subTest(page=page, target="//%s:%s" % (package, name)):
          build = _read(os.path.join(package, "BUILD"), _source_root())
          if name in _folder_targets(package, build):
            continue
          self.assertRegex(build, r'name = "%s"' % name)

  def testEveryFileItNamesExists(self):
    for page in _pages():
      for path in sorted(set(re.findall(
          r"\b((?:tests|tf1_safe_train|bench|examples|docs)/[\w/.]+"
          r"\.(?:py|md))", _read(page)))):
        with self.subTest(page=page, path=path):
          self.assertTrue(
              os.path.exists(os.path.join(_source_root(), path)), path)

  def testTheBazelConsumersReadmeCopiesWhatCiCopies(self):
    # .ci/run copies the example out of the repository and runs it there:
    # the files its README's `cp` line names, which must be every file the
    # example has but that README (a file left out would work in place and
    # not in a user's copy).
    consumer = os.path.join(_source_root(), "examples", "bazel_consumer")
    copied = _consumer_copy_line(
        _read("examples/bazel_consumer/README.md", _source_root()))
    self.assertIsNotNone(copied)
    self.assertCountEqual(
        copied, [n for n in os.listdir(consumer) if n != "README.md"])
    ci = re.search(r"(?m)^consumer_files=\((.*)\)$",
                   _read(".ci/run", _source_root()))
    self.assertIsNotNone(ci)
    self.assertEqual(copied, ci.group(1).split())
    workspace = _read("examples/bazel_consumer/WORKSPACE", _source_root())
    self.assertRegex(workspace, r'(?m)^TF1_SAFE_TRAIN = "\.\./\.\."$')

  def testEveryBinaryRunsFromAnotherWorkspace(self):
    # Without --incompatible_default_to_explicit_init_py (another
    # workspace's default), a py_binary's runfiles get an empty __init__.py
    # in the directory of the repository, named tf1_safe_train, which
    # `import tf1_safe_train` then finds (examples/bazel_consumer/BUILD).
    for build in ("tf1_safe_train/BUILD", "examples/bazel_consumer/BUILD"):
      blocks = re.findall(r"(?ms)^py_binary\((.*?)^\)",
                          _read(build, _source_root()))
      self.assertNotEmpty(blocks, build)
      for block in blocks:
        with self.subTest(build=build, binary=block.split("\n")[1].strip()):
          self.assertIn("legacy_create_init = False,", block)

  def testLayoutPageNamesEveryModule(self):
    # docs/layout.md's tree is the map a reader starts from: a module added
    # to the library, the trainer or the cluster package must appear there.
    page = _read("docs/layout.md")
    # (The trainer's modules sit in folders of their own: walked.)
    for package in ("core", "trainer", "cluster"):
      directory = os.path.join(_source_root(), "tf1_safe_train", package)
      for folder, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
          if name.endswith(".py") and name != "__init__.py":
            with self.subTest(module=os.path.relpath(
                os.path.join(folder, name), directory)):
              self.assertRegex(page, r"(?m)^ +%s +\S" % re.escape(name))

  def testTheReadmesIdiomsAreTheWrapperTablesRows(self):
    # One list in two places: the README names each idiom of the wrapper
    # page's table, by the same name, with the same verdict (issue 33).
    table = idioms_table(_read("docs/wrapper.md"))
    self.assertIn("in-place statistics", table)
    self.assertEqual(table["Keras 2 updates"], "covered")
    self.assertDictEqual(idioms_list(_readme()), table)

  def testTheIdiomsParsersReadNamesAndVerdicts(self):
    self.assertEqual(idioms_table(
        "<!-- idioms-table -->\n| Idiom | The one line | Otherwise |\n"
        "|---|---|---|\n| **an  EMA**: grouped | **not covered**: moves | x |\n"
        "| **clipping**: `tf.clip` | **covered**: it skips | - |\n"
        "| a new row | covered | - |\n\nprose |"),
                     {"an EMA": "not covered", "clipping": "covered",
                      "a new row": None})
    self.assertEqual(idioms_list(
        "<!-- idioms: x -->\n- **covered**: a; `tf.b`\n  c.\n"
        "- **not covered**: d. The first run says so.\n<!-- /idioms -->"),
                     {"a": "covered", "`tf.b` c": "covered",
                      "d": "not covered"})

  def testFlagsTablesAreTheDeclaredFlags(self):
    tables = {}
    for page in _pages():
      tables.update(_flags_tables(_read(page)))
    self.assertCountEqual(tables, _FLAG_SPECS)
    for binary, specs in _FLAG_SPECS.items():
      with self.subTest(binary=binary):
        self.assertMultiLineEqual(
            flag_specs.markdown_table(specs), tables[binary],
            "regenerate the table: python tools/regen_docs.py")

  def testTheBinariesDefineTheDeclaredFlags(self):
    for binary, specs in _FLAG_SPECS.items():
      with self.subTest(binary=binary):
        result = _run(_DUMP_FLAGS.format(binary), self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr)
        defined = json.loads(result.stdout)
        declared = {}
        for spec in specs:
          help_text = spec.help
          if spec.choices:  # absl writes an enum's values before its help.
            help_text = "<%s>: %s" % ("|".join(spec.choices), help_text)
          declared[spec.name] = [spec.default, help_text,
                                 list(spec.choices) or None]
        self.assertDictEqual(defined, declared)


if __name__ == "__main__":
  tf.test.main()
