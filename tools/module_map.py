"""Writes docs/layout.md's map of tf1_safe_train/ from the package itself.

Usage: python tools/module_map.py [--check]   (from the repository's top)

The map is the page's first code block; its `tf1_safe_train/` tree (from
that line to the next line that is not indented) is generated: a line per
folder and module, each described by the first paragraph of its docstring
(a folder's by its `__init__.py`'s; the package's `__init__.py` by the
public names it exports). So a new module needs its docstring, no hand-written
line. The tree keeps the page's order (folders and modules in the order a
reader meets them); a module or folder not yet drawn goes last in its
folder. The rest of the block (the repository's files) is written by hand.
With --check, exits 1 if the page differs from what it would write;
tests/layout_test.py makes the same comparison.
"""

import ast
import os
import sys
import textwrap

_ROOT = "tf1_safe_train/"
_WIDTH = 78
# Where a description starts: this many columns after the entry's indent.
_COLUMN = 17


def summary(source):
  """The first paragraph of a module's docstring as one line, without its
  final period ("" if it has none)."""
  doc = ast.get_docstring(ast.parse(source)) or ""
  return " ".join(doc.split("\n\n")[0].split()).rstrip(".")


def public_names(source):
  """The names the package's __init__.py exports (its `_EXPORTS` and
  `_MODULES` dicts' keys), sorted as a reader looks them up."""
  names = []
  for node in ast.parse(source).body:
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and
        any(isinstance(t, ast.Name) and t.id in ("_EXPORTS", "_MODULES")
            for t in node.targets)):
      names += [k.value for k in node.value.keys]
  return sorted(names, key=str.lower)


def _read(path):
  with open(path) as f:
    return f.read()


def describe(package, path):
  """The map's description of `path` (relative to the package directory,
  folders ending in "/")."""
  if path == "__init__.py":
    return "the public names: " + ", ".join(
        public_names(_read(os.path.join(package, path))))
  if path.endswith("/"):
    path += "__init__.py"
  return summary(_read(os.path.join(package, path)))


def tree(package):
  """{folder ("" for the package's top, "core/", "trainer/step/"): its
  entries (modules' and subfolders' paths), sorted by name}."""
  found = {}
  for directory, dirs, files in os.walk(package):
    dirs[:] = sorted(d for d in dirs
                     if os.path.isfile(os.path.join(directory, d,
                                                    "__init__.py")))
    folder = os.path.relpath(directory, package)
    folder = "" if folder == "." else folder + "/"
    found[folder] = sorted(
        [folder + f for f in files if f.endswith(".py") and
         (f != "__init__.py" or not folder)] +
        [folder + d + "/" for d in dirs])
  return found


def drawn_order(lines):
  """The paths the tree's `lines` draw, in their order ("core/",
  "core/guard.py"); an entry is a line whose first words (before two
  spaces) all end in .py or /, nested by its indentation."""
  order = []
  stack = [(-1, "")]  # (indentation, folder path) of the open folders.
  for line in lines:
    names = line.strip().split("  ")[0].split()
    if not names or not all(n.endswith((".py", "/")) for n in names):
      continue
    indent = len(line) - len(line.lstrip())
    while stack[-1][0] >= indent:
      stack.pop()
    order += [stack[-1][1] + name for name in names]
    if names[-1].endswith("/"):
      stack.append((indent, stack[-1][1] + names[-1]))
  return order


def entry(depth, name, text):
  """One entry's lines: `name` indented for its `depth`, `text` wrapped in
  the description column."""
  indent = 2 * depth
  column = indent + _COLUMN
  head = " " * indent + name
  head = head.ljust(column) if len(head) + 2 <= column else head + "  "
  if not text:
    return [head.rstrip()]
  return textwrap.wrap(text, _WIDTH, initial_indent=head,
                       subsequent_indent=" " * column,
                       break_on_hyphens=False, break_long_words=False)


def render(package, order=()):
  """The tree's lines (after its `tf1_safe_train/` line), folders and
  modules in `order` where it names them, the others after, by name."""
  entries = tree(package)
  rank = {path: i for i, path in enumerate(order)}
  lines = []

  def draw(folder, depth):
    paths = sorted(entries[folder],
                   key=lambda p: (rank.get(p, len(rank)), p))
    for path in paths:
      name = path[len(folder):]
      lines.extend(entry(depth, name, describe(package, path)))
      if path.endswith("/"):
        draw(path, depth + 1)

  draw("", 1)
  return lines


def generate(page, package):
  """`page` (docs/layout.md's text) with its map's package tree written
  from `package` (the package's directory)."""
  lines = page.split("\n")
  start = lines.index(_ROOT)
  end = start + 1
  while end < len(lines) and (not lines[end].strip() or
                              lines[end].startswith(" ")):
    end += 1
  order = drawn_order(lines[start + 1:end])
  return "\n".join(lines[:start + 1] + render(package, order) + lines[end:])


def main(argv):
  top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  page_path = os.path.join(top, "docs", "layout.md")
  page = _read(page_path)
  new = generate(page, os.path.join(top, "tf1_safe_train"))
  if "--check" in argv[1:]:
    if new != page:
      print("docs/layout.md's map is out of date: python tools/module_map.py")
      return 1
    return 0
  if new != page:
    with open(page_path, "w") as f:
      f.write(new)
    print("docs/layout.md: map rewritten")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
