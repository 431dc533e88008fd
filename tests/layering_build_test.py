"""Bazel's visibility follows the folders' direction (docs/layout.md).

Every BUILD file under a folder of the package (subfolders too) sets as its
default_visibility the package group of its folder's layer
(tf1_safe_train/BUILD), and that group admits exactly the folders of that
layer and above, the package's top (the binaries' main modules), the tests
and the benchmarks. Read statically, like tests/layout_test.py's imports;
.ci/run shows Bazel enforcing it (a core target depending on a trainer one
fails to build).
"""

import os
import re
import unittest

import tf1_safe_train
from tests import layout_test

# Under Bazel the package's modules are links into the source tree, where
# the BUILD files are.
_PACKAGE = os.path.dirname(os.path.realpath(tf1_safe_train.__file__))
_TOP = "(top)"


def _read(*path):
  with open(os.path.join(_PACKAGE, *path)) as f:
    return f.read()


def _groups(build):
  """{group name: the folders it admits, _TOP for the package's own, and
  //tests/... or //bench/... as written}."""
  shared = re.search(r"^_TESTS_AND_BENCH = \[(.*?)\]", build, re.S | re.M)
  shared = re.findall(r'"([^"]+)"', shared.group(1)) if shared else []
  groups = {}
  folders = layout_test._folders()  # pylint: disable=protected-access
  for name, packages, plus in re.findall(
      r'package_group\(\s*name = "(\w+)",\s*packages = \[(.*?)\]'
      r"( \+ _TESTS_AND_BENCH)?", build, re.S):
    admitted = set()
    for label in re.findall(r'"([^"]+)"', packages) + (shared if plus else []):
      if label == "//tf1_safe_train/...":
        admitted.update(folders + [_TOP])
      elif label == "//tf1_safe_train":
        admitted.add(_TOP)
      else:
        match = re.match(r"//tf1_safe_train/(\w+)/\.\.\.$", label)
        admitted.add(match.group(1) if match else label)
    groups[name] = admitted
  return groups


def _visibility(build):
  match = re.search(r'^package\(default_visibility = \["([^"]+)"\]\)', build,
                    re.M)
  return match.group(1) if match else None


class LayeringBuildTest(unittest.TestCase):

  def testEachFolderAdmitsItsLayerAndAboveOnly(self):
    groups = _groups(_read("BUILD"))
    folders = layout_test._folders()  # pylint: disable=protected-access
    rank = layout_test._RANK  # pylint: disable=protected-access
    for folder in folders:
      expected = {f for f in folders if rank[f] >= rank[folder]}
      expected.update([_TOP, "//tests/...", "//bench/..."])
      for directory, _, files in os.walk(os.path.join(_PACKAGE, folder)):
        if "BUILD" not in files:
          continue
        build = os.path.relpath(os.path.join(directory, "BUILD"), _PACKAGE)
        with self.subTest(build=build):
          label = _visibility(_read(build))
          self.assertIsNotNone(label, "no package(default_visibility = ...)")
          self.assertTrue(label.startswith("//tf1_safe_train:"), label)
          self.assertEqual(groups.get(label.split(":")[1]), expected, label)

  def testTheCheckSeesAPublicFolder(self):
    self.assertEqual(
        _visibility('package(default_visibility = ["//visibility:public"])'),
        "//visibility:public")
    self.assertEqual(_groups(
        '_TESTS_AND_BENCH = [\n    "//tests/...",\n]\n'
        'package_group(\n    name = "g",\n    packages = [\n'
        '        "//tf1_safe_train",\n        "//tf1_safe_train/core/...",\n'
        '    ] + _TESTS_AND_BENCH,\n)\n'),
                     {"g": {_TOP, "core", "//tests/..."}})


if __name__ == "__main__":
  unittest.main()
