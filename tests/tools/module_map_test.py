"""tools/module_map.py: docs/layout.md's map of the package, generated."""

import os
import tempfile
import textwrap
import unittest

from tests import layout_test
from tests.fixtures import tool_modules


module_map = tool_modules.load("module_map")

_PAGE = textwrap.dedent("""\
    # Layout

    ```
    WORKSPACE          build
    tf1_safe_train/
      __init__.py      stale
      core/            stale
        zeta.py          first in the page's order
        gone.py          no longer in the package
    tests/             the tests
    ```

    Text after the map.
    """)


class ModuleMapTest(unittest.TestCase):

  def _package(self, modules):
    """A package in a temporary directory: {path: docstring} (the top
    __init__.py's: its source)."""
    top = tempfile.mkdtemp()
    for path, doc in modules.items():
      os.makedirs(os.path.dirname(os.path.join(top, path)), exist_ok=True)
      with open(os.path.join(top, path), "w") as f:
        f.write(doc if path == "__init__.py" else '"""%s"""\n\nX = 1\n' % doc)
    return top

  def testSummaryIsTheDocstringsFirstParagraph(self):
    self.assertEqual(module_map.summary(
        '"""The guard: one\n  decision.\n\nMore."""\n'), "The guard: one decision")
    self.assertEqual(module_map.summary("X = 1\n"), "")

  def testPublicNamesAreTheExportsKeys(self):
    self.assertEqual(module_map.public_names(
        '_EXPORTS = {"b": "m", "A": "m"}\n_MODULES = {"c": "m"}\nY = {"z": 1}\n'),
                     ["A", "b", "c"])

  def testANewModuleNeedsOnlyItsDocstring(self):
    top = self._package({
        "__init__.py": '_EXPORTS = {"Opt": "x"}',
        "core/__init__.py": "The library.",
        "core/zeta.py": "Zeta: the last by name.",
        "core/alpha.py": "Alpha, new: drawn after the page's modules.",
        "core/sub/__init__.py": "A subfolder.\n\nNot this paragraph.",
        "core/sub/beta.py": "Beta " + "word " * 20,
    })
    page = module_map.generate(_PAGE, top)
    self.assertIn(textwrap.dedent("""\
        tf1_safe_train/
          __init__.py      the public names: Opt
          core/            The library
            zeta.py          Zeta: the last by name
            alpha.py         Alpha, new: drawn after the page's modules
            sub/             A subfolder
              beta.py          Beta word word word word word word word word word word
                               word word word word word word word word word word
        tests/             the tests
        ```

        Text after the map.
        """), page)
    self.assertTrue(page.startswith("# Layout\n\n```\nWORKSPACE          build\n"))
    # What tests/layout_test.py reads of it: every folder and module.
    self.assertEqual(layout_test.map_of(page),
                     {"__init__.py", "core/", "core/zeta.py", "core/alpha.py",
                      "core/sub/", "core/sub/beta.py"})
    # Generated from itself, the page does not change.
    self.assertEqual(module_map.generate(page, top), page)

  def testALongNameStartsItsDescriptionTwoSpacesAfter(self):
    self.assertEqual(module_map.entry(2, "criterion_registry.py", "The registry"),
                     ["    criterion_registry.py  The registry"])
    self.assertEqual(module_map.entry(1, "core/", ""), ["  core/"])


if __name__ == "__main__":
  unittest.main()
