"""tools/regen_docs.py: the docs' generated parts, rewritten in place."""

import importlib.util
import os
import unittest


def _load():
  root = os.environ.get("TEST_SRCDIR")
  if root:
    root = os.path.join(root, os.environ["TEST_WORKSPACE"])
  else:
    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
  spec = importlib.util.spec_from_file_location(
      "regen_docs", os.path.join(root, "tools", "regen_docs.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


regen_docs = _load()


class RegenDocsTest(unittest.TestCase):

  def testEachMarkersTableIsReplacedAndTheRestKept(self):
    page = ("a\n<!-- flags-table: train -->\nold\n<!-- /flags-table -->\nb\n"
            "<!-- flags-table: eval -->\n<!-- /flags-table -->\n")
    self.assertEqual(
        regen_docs.with_flags_tables(page, {"train": "T\n", "eval": "E\n"}),
        "a\n<!-- flags-table: train -->\nT\n<!-- /flags-table -->\nb\n"
        "<!-- flags-table: eval -->\nE\n<!-- /flags-table -->\n")

  def testTheTablesAreTheBinariesDeclaredFlags(self):
    tables = regen_docs.flags_tables()
    self.assertEqual(sorted(tables), ["eval", "train"])
    self.assertIn("| `--train_dir` |", tables["train"])
    self.assertIn("| `--skip_grad_norm_above` |", tables["train"])


if __name__ == "__main__":
  unittest.main()
