"""Runs pytest on the test files given as arguments and exits with its code.

Every `py_test` of the project has this file as its main (see pytest.bzl), so
a test file holds only `tf.test.TestCase` classes and pytest collects them.
"""

import os
import sys

import pytest


def main(argv):
  args = list(argv[1:])
  args += ["-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args.append("--junitxml=" + xml)
  # Bazel's sharding and test filter map onto pytest's own selection.
  test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
  if test_filter:
    args += ["-k", test_filter]
  return pytest.main(args)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
