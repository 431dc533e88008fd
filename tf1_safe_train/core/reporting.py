"""The wrapper's last built step: its result, report and checks.

`LastStep` is the part of `SkipNonFiniteOptimizer` that holds what its last
`apply_gradients` built (the `guard.GuardResult`, the variables the step
handles, where its search for update ops started, its `write_check.Step`),
which `protect`, `variables`, the replay and the report read, and answers
the report API a script calls (`report_fetches`, `describe_skip`,
`check_train_op`); the report itself, the tensors and the line, is
`step_report.StepReport` (its words: `skip_report`).
"""

import tensorflow as tf

from tf1_safe_train.core import raw_gradients
from tf1_safe_train.core import rollback
from tf1_safe_train.core import step_report
from tf1_safe_train.core import write_check

tf1 = tf.compat.v1


class LastStep(object):
  """`SkipNonFiniteOptimizer`'s last built step, and its report.

  Attributes:
    result: the step's `guard.GuardResult`, or None before any step.
    variables: what the step handles (global_step, counters, rolled-back
      statistics, loss scale, criteria's state): `protect` leaves it alone.
    roots: where the step's (and `protect`'s) search for update ops starts.
    run_step: the step's `write_check.Step`, or None.
  """

  def __init__(self, name, increment_global_step_on_skip):
    """Args: the wrapper's name and `increment_global_step_on_skip`."""
    self._name = name
    self._increment_global_step_on_skip = increment_global_step_on_skip
    self.result = None
    self.variables = []
    self.roots = []
    self.run_step = None
    self._report = None
    self._report_args = None

  def get(self):
    """The last step's `guard.GuardResult`.

    Raises:
      ValueError: before any step.
    """
    if self.result is None:
      raise ValueError("apply_gradients (or minimize) has not been called")
    return self.result

  def set_report(self, result, global_step, towers, devices,
                 raw_grads=None):
    """Notes the last step's report; built when first asked for, so a step
    nobody reports on (the trainer's, which has its own) adds no op."""
    self._report = None
    self._report_args = (result, global_step, towers, devices, raw_grads)

  def report(self):
    """The last step's `step_report.StepReport`, built now if not yet."""
    if self._report is None:
      self.get()  # Raises the usual error before any step.
      result, global_step, towers, devices, raw_grads = self._report_args
      raw_flags = None
      with tf1.name_scope(self._name + "_report"):
        step = step_report.step_index(result, global_step,
                                      self._increment_global_step_on_skip)
        if raw_grads is not None and towers is None:
          raw_flags = raw_gradients.flags(raw_grads, result.applied)
      self._report = step_report.StepReport(step, result, towers, devices,
                                            raw_flags)
    return self._report

  def report_fetches(self, train_op=None):
    """What to fetch with the train op to report a skip (see `describe_skip`).

    In a plain `session.run` loop:

        report = opt.report_fetches(train_op)
        _, values = sess.run([train_op, report], feed_dict)
        line = opt.describe_skip(values)  # None on an applied step

    Args:
      train_op: optional, the train op the loop runs: it is checked now as
        `check_train_op` does (`report_hook()` checks what each run fetches).

    Returns:
      A dict of tensors of the last built step.
    """
    report = self.report()
    if train_op is not None:
      self.check_train_op(train_op)
    return report.fetches

  def describe_skip(self, values):
    """The skip report line from the fetched `report_fetches()`, or None.

    Like the trainer's: "skipped step 7: non-finite gradients in tower 1
    (/device:GPU:1); variables: conv1/weights" (towers when known:
    `tower_grads_and_vars=` or `apply_gradients_per_device`).
    """
    return self.report().describe(values)

  def check_train_op(self, train_op):
    """Names what `train_op` writes outside the skip decision.

    Warns once, listing every variable a run of `train_op` writes that a
    skipped step would change (an `ExponentialMovingAverage` without
    `protect()`, update ops grouped after `apply_gradients`, a hand-written
    assign), and a global_step the script advances too; with `strict=True`
    raises instead. (The first run of the step is checked so anyway,
    unless the wrapper was built with `check_runs=False`: `run_check`.)

    Args:
      train_op: an Operation or Tensor, or a list of them (what a run
        fetches).

    Returns:
      The list of those variables' names (empty if none), then
      "<global_step> (advanced twice: also by <ops>)" if so.

    Raises:
      ValueError: if `strict` and something is written outside the
        decision, or if `train_op` runs more than one guarded step.
    """
    self.get()  # Raises the usual error before any step.
    ops = [rollback.as_op(o) for o in tf.nest.flatten(train_op)]
    return write_check.check(ops, self.run_step)
