"""The hooks a wrapper user needs: the gated base, give-up, the skip line.

(The trainer's own hooks, progress, skip report, the last step and run stats,
are in trainer/run/hooks.py; signals in trainer/run/stop_signals.py.)

Every value a hook reports is read after the step's update (the counters come
from `counters.read_after`, the applied flag from the decision itself), never
from a raw variable read that is unordered relative to the update. Such reads
run the train op, so a hook fetches them only on runs that run it anyway
(`fetch_gate`): `sess.run(loss, {x: validation_batch})` never trains.
"""

from absl import logging
import tensorflow as tf

from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import skip_report
from tf1_safe_train.core import write_check

tf1 = tf.compat.v1


class GatedHook(tf1.train.SessionRunHook):
  """A hook whose fetches are added only to runs that run their effects.

  Subclasses set `self._fetches` and handle `after_run` only when
  `self._fetched` (True when this run carried the hook's fetches). A run
  that executes two steps built by `SkipNonFiniteOptimizer` (which would
  count one step twice) is refused before it runs.
  """

  _fetches = None
  _gate = None
  _fetched = False

  def begin(self):
    # A new session may come with a new graph: what was learned of the old
    # one's fetches does not hold.
    self._gate = None

  def check_new_run(self, ops):
    """Called before the first run of each distinct set of fetched `ops`."""
    write_check.check_one_step(ops)

  def before_run(self, run_context):
    if self._gate is None:
      self._gate = fetch_gate.FetchGate(self._fetches, self.check_new_run)
    self._fetched = self._gate.allows(run_context)
    if not self._fetched:
      return None
    return tf1.train.SessionRunArgs(self._fetches)


# (Their home is skip_report, which builds every skip's words.)
format_scale = skip_report.format_scale


def describe_skip(step, tower_flags, average_flags, variable_names,
                  tower_devices, max_names=5):
  """The line of a step skipped for non-finite gradients (see
  `skip_report.nonfinite_words` for the arguments)."""
  return skip_report.line(step, nonfinite=skip_report.nonfinite_words(
      tower_flags, average_flags, variable_names, tower_devices, max_names))


class GiveUpHook(GatedHook):
  """Stops the run after `max_consecutive_skips` skipped steps in a row.

  It requests a stop rather than raising, so the session closes normally and
  the final checkpoint is written: skipped steps change nothing of the model,
  so that checkpoint holds the last good state. `gave_up` tells the caller.
  """

  def __init__(self, consecutive_skips, max_consecutive_skips,
               setting="GiveUpHook's max_consecutive_skips"):
    """Creates the hook.

    Args:
      consecutive_skips: int tensor read after the step.
      max_consecutive_skips: give up when this many steps in a row were
        skipped; 0 never gives up.
      setting: what the user set `max_consecutive_skips` with, as the
        give-up line names it (a binary passes its flag,
        "--max_consecutive_skips").
    """
    self._fetches = consecutive_skips
    self._max = max_consecutive_skips
    self._setting = setting
    self.gave_up = False

  def after_run(self, run_context, run_values):
    if self._fetched and self._max and run_values.results >= self._max:
      self.gave_up = True
      logging.error("giving up: %d consecutive steps skipped (%s=%d)",
                    run_values.results, self._setting, self._max)
      run_context.request_stop()
