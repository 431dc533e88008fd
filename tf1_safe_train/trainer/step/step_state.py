"""The trainer step's run bookkeeping: its variables, updates and reads.

`StepState` holds what a run counts beside the model: global_step, the skip
counters, the non-finite steps per tower and the longest skip streak seen.
The step updates the last two after its decision (`updates`) and every
report reads them after the step (`totals`), as `run_summary.json` does.
"""

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib

tf1 = tf.compat.v1


class StepState(object):
  """The state variables of the trainer's step (build it on the variables'
  device: in a cluster, the workers share them)."""

  def __init__(self, num_towers):
    self.global_step = tf1.train.get_or_create_global_step()
    self.counters = counters_lib.skip_counters()
    # Shared by the workers of a cluster: tower i counts for tower i of
    # every worker (the skip reports name the worker).
    self.nonfinite_by_tower = tf1.Variable(
        tf.zeros([num_towers], tf.int64), trainable=False,
        name="nonfinite_steps_by_tower")
    self.max_seen = tf1.Variable(tf.constant(0, tf.int64), trainable=False,
                                 name="max_consecutive_skips_seen")
    # Read once per step; the drill and the reports use the same value.
    self.step_index = tf.identity(self.global_step.read_value(),
                                  name="step_index")

  @property
  def variables(self):
    """`train_step.Step.variables`: the variables themselves."""
    return {"global_step": self.global_step, "counters": self.counters,
            "nonfinite_steps_by_tower": self.nonfinite_by_tower,
            "max_consecutive_skips_seen": self.max_seen}

  def updates(self, step_op, tower_nonfinite):
    """The ops that count the step's non-finite towers and the streak,
    after `step_op` (the decision)."""
    with tf1.control_dependencies([step_op]):
      return [
          tf1.assign_add(self.nonfinite_by_tower,
                         tf.cast(tower_nonfinite, tf.int64)),
          tf1.assign(self.max_seen, tf.maximum(
              self.max_seen.read_value(),
              self.counters.consecutive_skips.read_value())),
      ]

  def totals(self, train_op, reasons):
    """The reads after `train_op` that the run summary reports.

    Args:
      train_op: the whole step.
      reasons: the guarded step's `reasons.Report`: its counters (the
        variables, not the decision's report: a sync worker reads the
        chief's counts too).

    Returns:
      (dict: global_step, counters, nonfinite_steps_by_tower,
      max_consecutive_skips_seen, skip_reasons; the `SkipCounters` read).
    """
    after = counters_lib.read_after(self.counters, train_op)
    with tf1.control_dependencies([train_op]):
      return {
          "global_step": tf.identity(self.global_step.read_value()),
          "counters": after,
          "nonfinite_steps_by_tower": tf.identity(
              self.nonfinite_by_tower.read_value()),
          "max_consecutive_skips_seen": tf.identity(
              self.max_seen.read_value()),
          "skip_reasons": reasons.read_after(train_op)}, after
