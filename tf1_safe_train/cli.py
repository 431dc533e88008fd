"""What the binaries share at the edge: flags, logging and one-line errors.

Bad input (a flag, a data file, a cluster spec) must end the program with one
clear line naming the problem and a non-zero exit, never a traceback. The
binaries parse their flags before TensorFlow is imported, so a bad flag fails
at once and without TensorFlow's start-up messages.
"""

import logging
import os
import sys

from absl import flags
from absl import logging as absl_logging

EXIT_BAD_INPUT = 2
_HELP_FLAGS = frozenset(["-?", "-h", "--help", "--helpshort", "--helpfull",
                         "--helpxml"])


def fail(program, message, exit_code=EXIT_BAD_INPUT):
  """Prints `<program>: error: <message>` on one line and exits."""
  message = " ".join(str(message).split())  # One line, whatever it held.
  sys.stderr.write("%s: error: %s\n" % (program, message))
  sys.stderr.flush()
  sys.exit(exit_code)


def fail_now(program, message, exit_code):
  """As `fail`, but ends the process at once (no interpreter teardown).

  For errors after which TensorFlow's own threads may still be running
  (e.g. an out-of-memory step): Python's teardown could crash under them.
  """
  try:
    sys.stdout.flush()
    fail(program, message, exit_code)
  except SystemExit:
    pass
  finally:
    os._exit(exit_code)  # pylint: disable=protected-access


def flags_parser(program):
  """Returns an absl `flags_parser` that reports bad flags in one line."""

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      fail(program, "%s (see --helpfull)" % e)
    except SystemExit:
      # absl exits with 1 after printing --help/--helpfull; asking for help
      # is not a failure (and `bazel run` would report one).
      if any(arg.split("=")[0] in _HELP_FLAGS for arg in argv[1:]):
        sys.exit(0)
      raise

  return parse


def resolve_path(path):
  """Resolves a relative `path` against the directory `bazel run` ran from.

  `bazel run` starts the binary in its runfiles tree; Bazel exports the
  user's directory as BUILD_WORKING_DIRECTORY.

  Args:
    path: a path, or '' (returned as is).

  Returns:
    An absolute path, or ''.
  """
  if not path:
    return path
  path = os.path.expanduser(path)
  base = os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd())
  return os.path.normpath(os.path.join(base, path))


# The one INFO line of TensorFlow's a user needs by default: the checkpoint a
# restarted run resumes from.
_TF_INFO_KEPT = ("Restoring parameters from ",)


class _QuietTensorFlow(logging.Filter):
  """Passes TensorFlow's warnings and errors, not its INFO or deprecations.

  TensorFlow's INFO lines (hooks created, graph finalized, three lines per
  checkpoint) and its deprecation notices (logged as warnings, naming
  TensorFlow's own call sites) would drown the run's own lines.
  """

  def filter(self, record):
    if record.filename == "deprecation.py":
      return False
    if record.levelno >= logging.WARNING:
      return True
    return str(record.msg).startswith(_TF_INFO_KEPT)


def _cpp_min_log_level(verbosity):
  """TF_CPP_MIN_LOG_LEVEL for absl's `verbosity` (INFO 0 ... FATAL -3)."""
  return str(min(3, max(0, -verbosity)))


def import_tensorflow(default_verbosity=absl_logging.INFO):
  """Imports TensorFlow after flag parsing, with its logging tamed.

  Unless absl's --verbosity (-v) is given, the program's own lines are logged
  from `default_verbosity` up, and TensorFlow's warnings and errors, not its
  INFO lines (but for the checkpoint a run resumes from) nor its deprecation
  notices. --verbosity=0 logs every INFO line, TensorFlow's (Python and C++)
  too; --verbosity=-1 only warnings (without deprecation notices). An
  explicit TF_CPP_MIN_LOG_LEVEL in the environment wins for TensorFlow's C++
  lines.

  (TensorFlow 2.21 prints its oneDNN notice twice while it is imported,
  before its logging honours TF_CPP_MIN_LOG_LEVEL, from two libraries that
  each hold a copy of the code: only TF_ENABLE_ONEDNN_OPTS=0, which changes
  the kernels and so the numerics, silences it. It is left alone.)

  Args:
    default_verbosity: the absl level (e.g. `absl.logging.INFO`) of the
      program's own lines when --verbosity is not given.

  Returns:
    The `tensorflow` module.
  """
  given = flags.FLAGS["verbosity"].present
  if not given:
    absl_logging.set_verbosity(default_verbosity)
  verbosity = absl_logging.get_verbosity()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", _cpp_min_log_level(
      verbosity if given else absl_logging.WARNING))
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # TF's own handler would print every record a second time next to absl's.
  tf.get_logger().handlers = []
  if verbosity < absl_logging.INFO or not given:
    tf.get_logger().addFilter(_QuietTensorFlow())
  return tf


_OP_ERROR_NOISE = ("Graph execution error", "Detected at node", "File ",
                   "Node:", "[[", "(most recent call last)")


def describe_op_error(error):
  """One line for a TensorFlow `OpError`: its type and what went wrong.

  TF 2.x messages start with "Graph execution error:" and a stack of the
  node's definition; the cause (e.g. a failed assertion's message) comes
  after it.

  Args:
    error: a `tf.errors.OpError`.

  Returns:
    A one-line string.
  """
  lines = [l.strip() for l in (error.message or "").splitlines() if l.strip()]
  causes = [l for l in lines
            if "assertion failed" in l or "OOM when allocating" in l]
  if not causes:
    causes = [l for l in lines if not l.startswith(_OP_ERROR_NOISE)]
  return "%s: %s" % (type(error).__name__,
                     (causes or lines or [""])[0])
