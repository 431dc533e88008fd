"""How a binary was launched: the pip package's console scripts, and the
command a user ran, which its --help shows.

`pip install` puts `tf1-safe-train`, `tf1-safe-train-eval`,
`tf1-safe-train-replay` and `tf1-safe-train-local-cluster` on the PATH
(pyproject.toml, [project.scripts]): each runs its binary's module as
`python -m tf1_safe_train.NAME` does, so that absl finds its flags and
docstring in `__main__` (--help lists them).
"""

import os
import runpy
import sys


def _run(binary):
  # As `python -m`: the module is `__main__` (absl reads its docstring and
  # files its flags under sys.argv[0], which runpy sets to the module's file).
  runpy.run_module("tf1_safe_train." + binary, run_name="__main__",
                   alter_sys=True)


def train():
  """`tf1-safe-train`: runs `//:train`."""
  _run("train")


def evaluate():
  """`tf1-safe-train-eval`: runs `//:eval`."""
  _run("eval")


def replay():
  """`tf1-safe-train-replay`: runs `//:replay`."""
  _run("replay")


def local_cluster():
  """`tf1-safe-train-local-cluster`: runs `//:local_cluster`."""
  _run("local_cluster")


def command(program):
  """The command the user ran binary `program` ('train', ...) with.

  Up to its flags, as they would type it again: `python -m
  tf1_safe_train.train`, a console script by its name (`tf1-safe-train`),
  under Bazel `./bazelw run //:train --` in this repository and `bazel run
  @tf1_safe_train//:train --` from another workspace (which has no
  ./bazelw). `sys.orig_argv` is the interpreter's own command line, which
  neither `runpy` (the console scripts) nor the Bazel stub rewrites.

  Args:
    program: the binary's name, as in its Bazel target.

  Returns:
    The command, e.g. 'python -m tf1_safe_train.train'.
  """
  argv = sys.orig_argv
  script = None
  for i, arg in enumerate(argv[1:], 1):
    if arg == "-m" and i + 1 < len(argv):
      return "python -m " + argv[i + 1]
    if not arg.startswith("-"):
      script = arg
      break
  if script is None or ".runfiles" + os.sep in os.path.abspath(script):
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    if workspace and not os.path.isfile(os.path.join(workspace, "bazelw")):
      return "bazel run @tf1_safe_train//:%s --" % program
    return "./bazelw run //:%s --" % program
  return os.path.basename(script)


def name_the_command(program):
  """Puts `command(program)` in the usage text --help prints.

  absl prints `__main__`'s docstring, whose example is written
  `./bazelw run //:train -- ...`: a pip user is shown what they ran.

  Args:
    program: the binary's name, as in its Bazel target.
  """
  main = sys.modules.get("__main__")
  bazelw = "./bazelw run //:%s --" % program
  doc = getattr(main, "__doc__", None)
  if doc and bazelw in doc:
    main.__doc__ = doc.replace(bazelw, command(program))
