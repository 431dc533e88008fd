"""The hooks a wrapper user needs: the gated base, give-up, the skip line.

(The trainer's own hooks, progress, skip report, the last step and run stats,
are in trainer/hooks.py; signals in trainer/stop_signals.py.)

Every value a hook reports is read after the step's update (the counters come
from `counters.read_after`, the applied flag from the decision itself), never
from a raw variable read that is unordered relative to the update. Such reads
run the train op, so a hook fetches them only on runs that run it anyway
(`fetch_gate`): `sess.run(loss, {x: validation_batch})` never trains.
"""

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import fetch_gate
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


def format_scale(scale):
  """A loss scale as printed: whole numbers in full (1048576, not 1.04858e+06)."""
  scale = float(scale)
  if scale.is_integer() and abs(scale) < 2.0**53:
    return "%d" % scale
  return "%g" % scale


def describe_skip(step, tower_flags, average_flags, variable_names,
                  tower_devices, max_names=5):
  """Returns the one-line report of a skipped step.

  Args:
    step: the step index (global_step at its start).
    tower_flags: bool array [num_towers, num_variables], per-tower non-finite
      gradient flags, or [num_towers], one fused flag per tower (the
      trainer's: the variables are then named by `average_flags` alone, as
      a non-finite value of any tower survives averaging).
    average_flags: bool array [num_variables], flags of the averaged gradients.
    variable_names: names aligned with the flags' last axis.
    tower_devices: device string of each tower ("" if unknown: not shown).
    max_names: how many variable names to list before "+N more".

  Returns:
    A string.
  """
  tower_flags = np.asarray(tower_flags, dtype=bool)
  by_variable = np.asarray(average_flags, dtype=bool)
  if tower_flags.ndim != 1:
    tower_flags = tower_flags.reshape(len(tower_devices), -1)
    by_variable = tower_flags.any(axis=0) | by_variable
  tower_flags = tower_flags.reshape(len(tower_devices), -1)
  bad_towers = [i for i in range(len(tower_devices)) if tower_flags[i].any()]
  names = [n for n, bad in zip(variable_names, by_variable) if bad]
  shown = ", ".join(names[:max_names])
  if len(names) > max_names:
    shown += ", ... (+%d more, %d in all)" % (len(names) - max_names,
                                             len(names))
  if bad_towers:
    where = "in tower%s %s" % (
        "s" if len(bad_towers) > 1 else "",
        ", ".join("%d (%s)" % (i, tower_devices[i]) if tower_devices[i]
                  else "%d" % i for i in bad_towers))
  else:
    where = "in the averaged gradients (every tower was finite: overflow)"
  return "skipped step %d: non-finite gradients %s; variables: %s" % (
      step, where, shown or "-")


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
