"""The model's state is finite: checked after a suspect step and before a save.

An *applied* step can write Inf/NaN into the model (a learning rate too large
for the model, an optimizer slot that overflows float32): its gradients were
finite, so the guard had nothing to skip. `FiniteStateCheck` reads one
is-finite flag per floating global variable in one `session.run`. Good steps
never pay for it: `NonFiniteStateHook` runs it only on the first skip after an
applied step (a non-finite state makes the next gradients non-finite, so it
shows as a skip), and `checkpoints.FiniteSaver` before each save.
"""

from absl import logging
import tensorflow as tf

from tf1_safe_train.core import hooks

tf1 = tf.compat.v1


def likely_cause(params):
  """The settings of `params` that can make an applied step write Inf/NaN."""
  return ("--learning_rate=%g too large for --model=%s with --optimizer=%s%s, "
          "or an optimizer slot that overflowed (lower --learning_rate, or "
          "set --clip_gradient_norm)" % (
              params.learning_rate, params.model, params.optimizer,
              "" if params.precision == "fp32" else
              " at --precision=" + params.precision))


def describe_names(names, max_names=5):
  """`names` joined, the first `max_names` shown, then "+N more"."""
  shown = ", ".join(names[:max_names])
  if len(names) > max_names:
    shown += ", ... (+%d more, %d in all)" % (len(names) - max_names,
                                             len(names))
  return shown


class FiniteStateCheck(object):
  """One is-finite flag per floating global variable, built once."""

  def __init__(self, variables=None):
    """Builds the flags in the default graph (before it is finalized).

    Args:
      variables: the variables to check; default: every floating global
        variable (weights, optimizer slots, moving statistics, EMA shadows,
        the loss scale).
    """
    if variables is None:
      variables = tf1.global_variables()
    self._variables = [v for v in variables if v.dtype.base_dtype.is_floating]
    self.names = [v.op.name for v in self._variables]
    flags = []
    with tf1.name_scope("finite_state"):
      for v in self._variables:
        with v.graph.colocate_with(v):  # One bool crosses the network, not v.
          flags.append(tf.reduce_all(tf.math.is_finite(v.read_value())))
      self._flags = tf.stack(flags) if flags else None

  def nonfinite(self, session):
    """Names of the variables holding a NaN or an Inf in `session`, in order."""
    if self._flags is None:
      return []
    finite = session.run(self._flags)
    return [n for n, ok in zip(self.names, finite) if not ok]


class NonFiniteStateHook(hooks.GatedHook):
  """Stops the run when a skip follows a step that wrote a non-finite state.

  It checks the state on the first skip of each streak (and on a first step
  skipped after a restore): a streak of skips that a poisoned batch explains
  costs one check; one that a poisoned model explains stops at once, rather
  than after `--max_consecutive_skips` useless steps. A save refused for a
  non-finite state (`refuse_save`, called by `checkpoints.FiniteSaver`, whose
  hook runs before this one) stops the run after the same step. `report`
  holds the one-line explanation (None if the state stayed finite).
  """

  def __init__(self, check, step_index, applied, cause):
    """Creates the hook.

    Args:
      check: a `FiniteStateCheck`.
      step_index: int scalar tensor, global_step at the start of the step.
      applied: bool scalar tensor, the step's decision.
      cause: text naming the likely causes (the settings that can write a
        non-finite state), appended to the report.
    """
    self._check = check
    self._fetches = {"step": step_index, "applied": applied}
    self._cause = cause
    self._last_applied = None  # Step index of the last applied step seen.
    self._previous_applied = True  # A first skip after a restore checks too.
    self._refused = None  # (step, names) of the first refused save.
    self._report = None

  @property
  def report(self):
    if self._report is None and self._refused is not None:
      self._report = self.describe(*self._refused)  # Refused at the end.
    return self._report

  def refuse_save(self, step, bad):
    """Records a save refused at `step` for non-finite variables `bad`."""
    if self._refused is None:  # The first finding explains; others repeat.
      self._refused = (step, bad)

  def after_run(self, run_context, run_values):
    if not self._fetched:  # A run that did not run the step (GatedHook).
      return
    results = run_values.results
    applied = bool(results["applied"])
    previous, self._previous_applied = self._previous_applied, applied
    if applied:
      self._last_applied = int(results["step"])
    bad = None
    if self._refused is not None:
      bad = self._refused[1]
    elif not applied and previous:
      bad = self._check.nonfinite(run_context.session)
    if not bad:
      return
    if self._report is None:
      self._report = (self.describe(*self._refused) if self._refused else
                      self.describe(int(results["step"]), bad))
      logging.error("%s", self._report)
    run_context.request_stop()

  def describe(self, step, bad):
    """The one-line report of non-finite variables `bad` found at `step`."""
    if self._last_applied is None:
      origin = "the restored checkpoint or the initial values already held it"
    else:
      origin = ("written by applied step %d, whose gradients were finite" %
                self._last_applied)
    return ("non-finite model state at step %d (%s): %s; likely cause: %s; "
            "no checkpoint holds it" % (step, origin, describe_names(bad),
                                        self._cause))
