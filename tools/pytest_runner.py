"""Runs pytest on the test files given as arguments and exits with its code.

Every `py_test` of the project has this file as its main (see pytest.bzl), so
a test file holds only `tf.test.TestCase` classes and pytest collects them.
Bazel's test filter (--test_filter) and sharding (`shard_count`) map onto
pytest's own selection.
"""

import atexit
import logging
import os
import sys

import pytest


def shard(items, index, total):
  """The items shard `index` of `total` runs: every total-th, from index.

  Round robin in collection order, so a test class's tests spread over the
  shards (and each shard pays that class's setUpClass once at most).
  """
  return [item for i, item in enumerate(items) if i % total == index]


class _Shard(object):
  """A pytest plugin that keeps one Bazel shard's tests (TEST_SHARD_INDEX of
  TEST_TOTAL_SHARDS) and deselects the others."""

  def __init__(self, index, total):
    self._index, self._total = index, total

  def pytest_collection_modifyitems(self, config, items):
    kept = shard(items, self._index, self._total)
    config.hook.pytest_deselected(
        items=[item for item in items if item not in kept])
    items[:] = kept


def main(argv):
  args = list(argv[1:])
  args += ["-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args.append("--junitxml=" + xml)
  test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
  if test_filter:
    args += ["-k", test_filter]
  plugins = []
  total = int(os.environ.get("TEST_TOTAL_SHARDS", "0") or 0)
  if total > 1:
    # Tells Bazel this runner shards (else it warns and runs all per shard).
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:
      open(status, "a").close()
    plugins.append(_Shard(int(os.environ["TEST_SHARD_INDEX"]), total))
  code = pytest.main(args, plugins=plugins)
  # A shard left no test (more shards than tests) has nothing to fail.
  if code == pytest.ExitCode.NO_TESTS_COLLECTED and plugins:
    return 0
  return code


def exit_now(code):
  """Ends the process with `code` once its output and exit handlers ran.

  pytest has written its report (and the JUnit XML Bazel reads) when it
  returns. A normal exit would then also tear down every module TensorFlow
  loaded and TensorFlow itself: about 0.8 CPU s per test process, for
  nothing (a process that imported TensorFlow, ran a session and exited
  took 4.2 s so, 3.3 s this way). The exit handlers still run: the tests'
  own (servers closed, temporary folders removed) and TensorFlow's.
  """
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(int(code))


if __name__ == "__main__":
  exit_now(main(sys.argv))
