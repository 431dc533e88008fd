"""What the binaries share at the edge: flags, logging and one-line errors.

Bad input (a flag, a data file, a cluster spec) must end the program with one
clear line naming the problem and a non-zero exit, never a traceback. The
binaries parse their flags before TensorFlow is imported, so a bad flag fails
at once and without TensorFlow's start-up messages.
"""

import importlib.util
import logging
import math
import os
import signal
import sys

from absl import flags
from absl import logging as absl_logging

import tf1_safe_train
from tf1_safe_train import console

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


class StartUpSignal(KeyboardInterrupt):
  """SIGTERM before training started, raised in the main thread.

  A KeyboardInterrupt, as Ctrl-C's is: code that cleans up after Ctrl-C
  cleans up after it too.
  """

  def __init__(self, signum):
    super(StartUpSignal, self).__init__(signum)
    self.signum = signum


def _raise_start_up_signal(signum, frame):
  del frame  # Unused.
  raise StartUpSignal(signum)


# The trainer's own handlers (`stop_signals`) replace this one when training
# starts and, when they are removed, restore the default instead: a signal
# while the run's summary is written is not "before training started".
_raise_start_up_signal.start_up_only = True


def raise_on_sigterm_during_start_up():
  """Until training starts, SIGTERM raises `StartUpSignal` (one line then,
  instead of the silent default death)."""
  signal.signal(signal.SIGTERM, _raise_start_up_signal)


def start_up_interrupted(program, error):
  """Ends the program after Ctrl-C or SIGTERM during its start-up.

  Args:
    program: the binary's name.
    error: the KeyboardInterrupt (a `StartUpSignal` for SIGTERM).
  """
  signum = getattr(error, "signum", signal.SIGINT)
  fail(program, "%s before training started: stopped, nothing trained" % (
      "interrupted" if signum == signal.SIGINT else
      "signal %d (%s)" % (signum, signal.Signals(signum).name)),
       128 + signum)


def flags_parser(program):
  """Returns an absl `flags_parser` that reports bad flags in one line."""

  def parse(argv):
    console.name_the_command(program)  # Before --help prints it.
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      fail(program, "%s (see --helpfull)" % e)
    except SystemExit:
      # absl exits with 1 after printing --help/--helpfull; asking for help
      # is not a failure (and `bazel run` would report one).
      if any(arg.split("=")[0] in _HELP_FLAGS for arg in argv[1:]):
        sys.exit(0)
      raise
    problem = nonfinite_float_flag(flags.FLAGS, argv)
    if problem:
      fail(program, problem)
    return rest

  return parse


def nonfinite_float_flag(parsed, argv):
  """Why a float flag's value is refused (NaN or +-Inf), or None.

  A NaN or infinite learning rate, grace period... breaks the run in ways a
  guard cannot undo; every binary refuses them when it parses its flags.
  Python reads "1e400" as inf: the line names what the user typed.

  Args:
    parsed: the parsed `flags.FLAGS`.
    argv: the command line they were parsed from.

  Returns:
    One line naming the first such flag as given, or None.
  """
  for name in sorted(set(parsed)):
    flag = parsed[name]
    value = flag.value
    if (not isinstance(flag.parser, flags.FloatParser) or
        not isinstance(value, float) or math.isfinite(value)):
      continue
    typed = _typed_value(name, argv)
    if typed is None or typed.strip().lower().lstrip("+-") in (
        "nan", "inf", "infinity"):
      return "--%s=%s: must be a finite number" % (
          name, typed if typed is not None else value)
    return ("--%s=%s: must be a finite number (%s overflows a float, whose "
            "largest value is about 1.8e308)" % (name, typed, typed.strip()))
  return None


def _typed_value(name, argv):
  """The text the last `--name=X` (or `--name X`) of `argv` gave, or None."""
  typed = None
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    for prefix in ("--" + name, "-" + name):
      if arg.startswith(prefix + "="):
        typed = arg[len(prefix) + 1:]
      elif arg == prefix and i + 1 < len(argv):
        typed = argv[i + 1]
  return typed


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
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    # The pip package does not require TensorFlow (pyproject.toml): one
    # line saying what to install, not the import's traceback.
    program = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    if importlib.util.find_spec("tensorflow") is None:
      fail(program, tf1_safe_train.NO_TENSORFLOW)
    fail(program, "TensorFlow is installed but cannot be imported (%s: %s); "
         "reinstall the one tf1_safe_train is tested with (2.21): %s" % (
             type(e).__name__, e, tf1_safe_train.INSTALL_TENSORFLOW))
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
