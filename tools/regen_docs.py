"""Rewrites the docs' generated parts: python tools/regen_docs.py

Run from the repository's top after adding or changing a module, a flag or
a criterion: docs/layout.md's map of the package (tools/module_map.py:
each module's docstring) and the flags tables of the docs' pages (between
`<!-- flags-table: train -->` and `<!-- /flags-table -->`: the binaries'
declared flags, `flag_specs.markdown_table`). tests/layout_test.py and
tests/readme_test.py compare the committed pages with what this writes.
Needs no TensorFlow.
"""

import glob
import importlib.util
import os
import re
import sys

_TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _TOP)

# pylint: disable=wrong-import-position
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.config import params


def flags_tables():
  """{binary: its flags table}, as the docs' pages hold them."""
  return {
      "train": flag_specs.markdown_table(
          flag_specs.of_params(params.TrainParams) + cluster_flags.FLAGS),
      "eval": flag_specs.markdown_table(
          flag_specs.of_params(params.EvalParams)),
  }


def with_flags_tables(page, tables):
  """`page` with each flags-table marker's table replaced."""
  return re.sub(
      r"(<!-- flags-table: (\w+) -->\n)(.*?)(<!-- /flags-table -->)",
      lambda m: m.group(1) + tables[m.group(2)] + m.group(4), page,
      flags=re.S)


def _module_map():
  spec = importlib.util.spec_from_file_location(
      "module_map", os.path.join(_TOP, "tools", "module_map.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main():
  tables = flags_tables()
  for path in sorted(glob.glob(os.path.join(_TOP, "docs", "*.md"))):
    with open(path) as f:
      page = f.read()
    new = with_flags_tables(page, tables)
    if os.path.basename(path) == "layout.md":
      new = _module_map().generate(new, os.path.join(_TOP, "tf1_safe_train"))
    if new != page:
      with open(path, "w") as f:
        f.write(new)
      print("rewritten: %s" % os.path.relpath(path, _TOP))
  return 0


if __name__ == "__main__":
  sys.exit(main())
