"""Repository rule: a Python toolchain on the project's own virtualenv.

The interpreter path is absolute and machine-specific, so it is computed when
Bazel fetches this repository and never committed. `./bazelw` creates the
virtualenv before Bazel starts.
"""

def _venv_toolchain_impl(repository_ctx):
    workspace_root = repository_ctx.path(Label("//:WORKSPACE")).dirname
    interpreter = workspace_root.get_child(".venv").get_child("bin").get_child("python3")
    if not interpreter.exists:
        fail("No virtualenv interpreter at %s: run ./bazelw, which creates it." % interpreter)
    repository_ctx.file("BUILD", """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "venv_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    stub_shebang = "#!{interpreter}",
)

py_runtime_pair(
    name = "venv_runtime_pair",
    py3_runtime = ":venv_runtime",
)

toolchain(
    name = "py_toolchain",
    toolchain = ":venv_runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(interpreter = interpreter))

venv_toolchain = repository_rule(
    implementation = _venv_toolchain_impl,
    local = True,
    doc = "Registers the project's .venv interpreter as the Python toolchain.",
)
