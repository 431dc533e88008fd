"""tools/regen_docs.py: the docs' generated parts, rewritten in place."""

import unittest

from tests.fixtures import tool_modules


regen_docs = tool_modules.load("regen_docs")


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
