"""Runs pytest on the test files given as arguments and exits with its code.

Every `py_test` of the project has this file as its main (see pytest.bzl), so
a test file holds only `tf.test.TestCase` classes and pytest collects them.
A target runs a folder's files in one process (one TensorFlow import), each
shard its share of the files. Bazel's test filter (--test_filter) and
sharding (`shard_count`) map onto pytest's own selection.

  pytest_runner.py [--costs=FILE] TEST_FILE... [pytest arguments]

FILE: JSON, {test file name: seconds}, the files' recorded costs (their
tests' times in a run of the suite), by which the shards share the files
out (`shard_files`).
"""

import atexit
import collections
import json
import logging
import os
import resource
import sys

import pytest



def shard(items, index, total):
  """The items shard `index` of `total` runs: every total-th, from index.

  Round robin in collection order, so a test class's tests spread over the
  shards (and each shard pays that class's setUpClass once at most).
  """
  return [item for i, item in enumerate(items) if i % total == index]


def shard_files(costs_by_file, total):
  """[files of shard 0, ..., files of shard total-1]: whole files, the
  costliest first, each to the shard with the least cost so far.

  Whole files, so that a file's setUpClass runs, and its module's servers
  start, in one shard only; by cost, so that the shards end together.
  Deterministic: every shard computes the same split.
  """
  loads = [0.0] * total
  shares = [[] for _ in range(total)]
  for name in sorted(costs_by_file, key=lambda f: (-costs_by_file[f], f)):
    least = loads.index(min(loads))
    loads[least] += costs_by_file[name]
    shares[least].append(name)
  return shares


def _cost(path, costs):
  """`path`'s recorded cost; a file the table does not name (a new one)
  costs the table's (lower) median (any scale: only the ratios matter)."""
  if os.path.basename(path) in costs:
    return float(costs[os.path.basename(path)])
  known = sorted(float(c) for c in costs.values()) or [1.0]
  return known[(len(known) - 1) // 2]


def keep(paths, index, total, costs):
  """Which of the items at `paths` (one per test, in collection order) shard
  `index` of `total` runs: whole files by cost, or, with fewer files than
  shards, every total-th test (`shard`)."""
  files = list(collections.OrderedDict.fromkeys(paths))
  if len(files) < total:
    return shard(range(len(paths)), index, total)
  mine = set(shard_files({f: _cost(f, costs) for f in files}, total)[index])
  return [i for i, path in enumerate(paths) if path in mine]


class _Shard(object):
  """A pytest plugin that keeps one Bazel shard's tests (TEST_SHARD_INDEX of
  TEST_TOTAL_SHARDS) and deselects the others."""

  def __init__(self, index, total, costs):
    self._index, self._total, self._costs = index, total, costs

  def pytest_collection_modifyitems(self, config, items):
    paths = [str(item.path) for item in items]
    kept = [items[i] for i in keep(paths, self._index, self._total,
                                   self._costs)]
    config.hook.pytest_deselected(
        items=[item for item in items if item not in kept])
    items[:] = kept


def main(argv):
  args = list(argv[1:])
  costs = {}
  if args and args[0].startswith("--costs="):
    with open(args.pop(0)[len("--costs="):]) as f:
      costs = json.load(f)
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
    plugins.append(_Shard(int(os.environ["TEST_SHARD_INDEX"]), total, costs))
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
  # The process's CPU time and its reaped children's (forked servers and
  # their runs, binaries): what the suite's CPU figure adds up
  # (docs/layout.md), read from each shard's test.log.
  own, children = (resource.getrusage(who) for who in
                   (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  sys.stdout.write("pytest_runner: CPU %.1f s (own %.1f s, children %.1f s)\n"
                   % (own.ru_utime + own.ru_stime + children.ru_utime +
                      children.ru_stime, own.ru_utime + own.ru_stime,
                      children.ru_utime + children.ru_stime))
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(int(code))


if __name__ == "__main__":
  exit_now(main(sys.argv))
