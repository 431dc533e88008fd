"""`py_pytest`: a native py_test whose main runs pytest on its test files.

`py_pytest_folders`: one such py_test per folder of tests/, its files found
by glob (a new test file needs no BUILD entry; see docs/layout.md).
"""

def py_pytest(name, srcs = [], deps = [], data = [], costs = None, size = "medium", src = None, **kwargs):
    """Declares a py_test that runs pytest on `srcs`, in one process a shard.

    Args:
      name: target name.
      srcs: the test files, run by one pytest (each shard: its share).
      deps: py_library dependencies.
      data: runfiles.
      costs: a JSON file {test file name: seconds} by which the shards share
        the files out (tools/pytest_runner.py), or None.
      size: Bazel test size.
      src: one test file, as the per-file targets before folder targets
        declared it (the same as srcs = [src]).
      **kwargs: passed to native.py_test (tags, shard_count, env, ...).
    """
    if src:
        srcs = srcs + [src]
    args = []
    if costs:
        args.append("--costs=$(location %s)" % costs)
        data = data + [costs]
    native.py_test(
        name = name,
        srcs = srcs + ["//tools:pytest_runner.py"],
        main = "//tools:pytest_runner.py",
        args = args + ["$(location %s)" % src for src in srcs],
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        deps = deps,
        data = data,
        **kwargs
    )

def py_pytest_folders(top_name, shard_counts = {}, exclude = [], **kwargs):
    """One py_pytest per folder of this package, over its *_test.py files.

    A folder's target is named after it (tests/core/**/*_test.py:
    //tests:core_tests, subfolders included; not //tests:core, which would
    be a file in the runfiles where the folder tests/core is), the files
    directly in the package are `top_name`'s.
    The folders are found by glob, so a new folder or file, or a file moved
    into a subfolder, needs no BUILD edit.

    Args:
      top_name: the target of the package's own *_test.py files.
      shard_counts: {folder: shard_count}; 1 where not named.
      exclude: test files to leave out (declared by hand, e.g. manual ones).
      **kwargs: passed to every py_pytest (deps, data, costs, size, env, ...).
    """
    groups = {}
    for src in native.glob(["**/*_test.py"], exclude = exclude):
        folder = src.split("/")[0] + "_tests" if "/" in src else top_name
        groups.setdefault(folder, []).append(src)
    for name in sorted(groups.keys()):
        py_pytest(
            name = name,
            srcs = sorted(groups[name]),
            shard_count = shard_counts.get(name[:-len("_tests")], 1),
            **kwargs
        )
