"""`py_pytest`: a native py_test whose main runs pytest on one test file."""

def py_pytest(name, src, deps = [], size = "medium", **kwargs):
    """Declares a py_test that runs pytest on `src` and exits with its code.

    Args:
      name: target name.
      src: the test file (one per target).
      deps: py_library dependencies.
      size: Bazel test size.
      **kwargs: passed to native.py_test (tags, shard_count, data, ...).
    """
    native.py_test(
        name = name,
        srcs = [src, "//tools:pytest_runner.py"],
        main = "//tools:pytest_runner.py",
        args = ["$(location %s)" % src],
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        deps = deps,
        **kwargs
    )
