"""Parts of a step's decision that are no reason of their own to skip.

Criteria (`criteria.Criterion`) whose `reason` is None: the guard loops over
them with the reasons (`decide`, `on_apply`, `on_skip`, `variables`) but
counts and reports nothing for them. What they add to the step, through the
hooks below (a part overrides those it needs):

- `nonfinite_flag()`: a bool scalar or-ed into the non-finite verdict (a
  tower's flag: `NonFiniteToo`; the tower unit's whole-step skip);
- `keep_updates`: a bool scalar, False to roll back the update ops' writes
  on an applied step (tower 0 left out: `TowerUnit`);
- `Context.degraded`, `Context.skip_nonfinite`: what an overflow's reaction
  (a loss scale: `OnOverflow`) reads in the branches.
"""

import tensorflow as tf

from tf1_safe_train.core import criteria

tf1 = tf.compat.v1


def done(op_fn):
  """A cond branch that runs `op_fn()`'s op and returns a tensor."""
  def branch():
    with tf1.control_dependencies([op_fn()]):
      return tf.constant(True)
  return branch


class Part(criteria.Criterion):
  """A criterion with no reason: it acts in the branches, skips nothing."""

  reason = None
  keep_updates = None

  def decide(self, context):  # pylint: disable=unused-argument
    return None, {}

  def nonfinite_flag(self):
    """A bool scalar or-ed into the non-finite verdict, or None."""
    return None


class NonFiniteToo(Part):
  """More non-finite verdicts (e.g. one per tower: `any_nonfinite`)."""

  def __init__(self, flags):
    self.flags = tuple(flags)

  def nonfinite_flag(self):
    if not self.flags:
      return None
    flag = self.flags[0]
    for extra in self.flags[1:]:
      flag = tf.logical_or(flag, extra)
    return flag


class OnOverflow(Part):
  """An object's `on_apply()` / `on_skip()` (e.g. a `DynamicLossScale`):
  its `on_skip` on a non-finite skip only (a spike is no overflow), or on
  an applied step a tower left out (`Context.degraded`) overflowed."""

  def __init__(self, target):
    self.target = target

  def on_apply(self, context):
    if context.degraded is None:
      return self.target.on_apply()
    return tf.cond(context.degraded, done(self.target.on_skip),
                   done(self.target.on_apply), name="degraded")

  def on_skip(self, context):
    if context.skip_nonfinite is None:  # Every skip is non-finite.
      return self.target.on_skip()
    # Built in the branch functions: they run on a non-finite skip only.
    return tf.cond(context.skip_nonfinite, self.target.on_skip, tf.no_op,
                   name="nonfinite_skip")


class TowerUnit(Part):
  """The trainer's --skip_unit=tower (`trainer/tower_unit.TowerUnit`), for a
  step whose gradients already leave out bad towers: its `skip` skips the
  whole step (as non-finite); on an applied step, the update ops' writes
  are kept only if its `keep_updates` (else rolled back, and then not
  checked), an overflow's reaction runs if it is `degraded`, and its
  `on_apply()` runs; its `variables` are the decision's too."""

  def __init__(self, unit):
    self.unit = unit
    self.keep_updates = unit.keep_updates

  def decide(self, context):
    context.degraded = self.unit.degraded
    return None, {}

  def nonfinite_flag(self):
    return self.unit.skip

  def on_apply(self, context):
    return self.unit.on_apply()

  @property
  def variables(self):
    return list(self.unit.variables)
