"""The tower unit (`--skip_unit=tower`): leave out a bad tower, apply the rest.

A tower whose gradients or loss hold a NaN/Inf, or whose finite gradients
disagree with the other towers' (`--skip_tower_outliers`), is left out of
the step's average, selected away (never multiplied by 0: NaN * 0 is NaN), and the sum
of the healthy towers is divided by their number, inside the one decision
of the step; fewer than `min_healthy` healthy towers skip the whole step.
"""

import math

import tensorflow as tf

from tf1_safe_train.core import criteria
from tf1_safe_train.core import nonfinite
from tf1_safe_train.trainer.config import one_machine_only

tf1 = tf.compat.v1

REJECTED = "rejected_by_tower"


def min_healthy(requested, num_towers):
  """The --min_healthy_towers in force: 0 means half, rounded up."""
  return requested or int(math.ceil(num_towers / 2.0))


def refusal_in_cluster(params):
  """Why --skip_unit=tower cannot run in a cluster (one line), or None:
  `one_machine_only.tower_unit_refusal`."""
  return one_machine_only.tower_unit_refusal(params)


class TowerUnit(object):
  """Which towers a step leaves out, their average, and their counters.

  What the decision reads (`guard_parts.TowerUnit`; all built here, before
  the decision): `skip` (too few healthy towers: the whole step is skipped),
  `keep_updates` (tower 0 kept: its moving statistics' writes are kept;
  else rolled back on the applied step), `degraded` (some tower left out:
  a loss scale halves as on a skip), `on_apply()` (counts the left-out
  towers), `variables`.
  """

  def __init__(self, losses, tower_grads_and_vars, grad_flags, min_healthy_,
               variables_device, indices=None, num_towers=None,
               outliers=None):
    """Builds the towers' verdicts.

    Args:
      losses: each tower's loss (float32 scalars).
      tower_grads_and_vars: one list of (gradient, variable) per tower.
      grad_flags: each tower's bool scalar, True if a gradient of it is
        non-finite (`nonfinite.any_nonfinite`, the tower's fused check).
      min_healthy_: fewer healthy towers than this skip the step (>= 1).
      variables_device: where the counters live.
      indices: the towers' indices (default 0..); others are quarantined
        (never built; their flags read False).
      num_towers: every tower, built or not (default: len(losses)).
      outliers: optional bool [len(losses)], each built tower's outlier
        flag (`tower_outliers.TowerOutliers.judge`): left out too.
    """
    self.indices = list(indices or range(len(losses)))
    self.num_towers = num_towers or len(losses)
    self.num_active = len(losses)
    self.min_healthy = min_healthy_
    self.tower_grads_and_vars = [list(gv) for gv in tower_grads_and_vars]
    with tf1.name_scope("tower_unit"):
      loss_flags = tf.logical_not(tf.math.is_finite(tf.stack(losses)))
      left_out = tf.logical_or(tf.stack(grad_flags), loss_flags)
      degraded = tf.reduce_any(left_out)
      # bool [num_towers], the towers left out as outliers, or None.
      self.outliers = None
      if outliers is not None:
        self.outliers = self._every_tower(tf.unstack(outliers))
        left_out = tf.logical_or(left_out, outliers)
      healthy = tf.logical_not(left_out)
      self._healthy = tf.unstack(healthy)
      self.grad_flags = self._every_tower(grad_flags)
      self.loss_flags = self._every_tower(tf.unstack(loss_flags))
      self.left_out = tf.logical_or(self.grad_flags, self.loss_flags,
                                    name="left_out")
      self.num_healthy = tf.reduce_sum(tf.cast(healthy, tf.int32))
      self.skip = tf.less(self.num_healthy, min_healthy_, name="too_few")
      # The statistics are the first built tower's (tower 0's unless
      # quarantined).
      self.keep_updates = self._healthy[0]
      # A NaN/Inf tower left out (a loss scale halves as on a skip; the
      # report checks the left-out towers' variables).
      self.degraded = degraded
      # Any tower left out, an outlier too.
      self.any_left_out = (degraded if outliers is None
                           else tf.reduce_any(left_out))
      # The healthy towers' mean loss (all towers' when none is healthy).
      kept = [tf.where(h, l, tf.zeros_like(l))
              for h, l in zip(self._healthy, losses)]
      self.loss = tf.where(
          self.num_healthy > 0,
          tf.add_n(kept) / tf.cast(tf.maximum(self.num_healthy, 1),
                                   tf.float32),
          tf.add_n(losses) / float(self.num_towers), name="loss")
      # 1 / healthy towers; never a division by 0 (the step then skips).
      self._scale = 1.0 / tf.cast(tf.maximum(self.num_healthy, 1),
                                  tf.float32)
    with tf1.device(variables_device):
      # Optional in checkpoints of runs without the option.
      self.rejected = tf1.Variable(
          tf.zeros([self.num_towers], tf.int64), trainable=False, name=REJECTED,
          collections=[tf1.GraphKeys.GLOBAL_VARIABLES, criteria.OPTIONAL_STATE])

  def _every_tower(self, flags):
    """[num_towers] of the built towers' `flags`, False for the others."""
    if self.num_active == self.num_towers:
      return tf.stack(flags)
    by_index = dict(zip(self.indices, flags))
    return tf.stack([by_index.get(t, tf.constant(False))
                     for t in range(self.num_towers)])

  @property
  def variables(self):
    return [self.rejected]

  def on_apply(self):
    """Op for the apply branch: each left-out tower's `rejected` += 1."""
    left_out = self.left_out
    if self.outliers is not None:
      left_out = tf.logical_or(left_out, self.outliers)
    return tf1.assign_add(self.rejected, tf.cast(left_out, tf.int64))

  def nonfinite_variables(self, names):
    """bool [len(names)]: True where a left-out tower's gradient of that
    variable (by op name) is non-finite, for the skip report (the healthy
    average the decision checks has none: a whole-step skip would name no
    variable). Computed in a cond on `degraded`: a good step runs no check,
    only the cond's `Switch` per tower gradient."""
    by_variable = []
    for pairs in zip(*self.tower_grads_and_vars):
      grads = [g for g, _ in pairs if g is not None]
      if grads:
        by_variable.append((pairs[0][1].op.name, grads))
    with tf1.name_scope("tower_unit_report"):
      flags = tf.cond(self.degraded, lambda: tf.stack([
          tf.reduce_any(tf.stack([nonfinite.is_nonfinite(g) for g in grads]))
          for _, grads in by_variable] + [tf.constant(False)]),
                      lambda: tf.zeros([len(by_variable) + 1], tf.bool))
      # A name without a tower gradient (e.g. a statistic) reads the False.
      where = dict((n, i) for i, (n, _) in enumerate(by_variable))
      return tf.gather(flags, [where.get(n, len(by_variable)) for n in names])

  def average_gradients(self):
    """The healthy towers' average, variable by variable (like
    `towers.average_gradients`: colocated with the variable; None and
    `IndexedSlices` safe, a mix of dense and sparse densified)."""
    averaged = []
    with tf.name_scope("tower_unit_average"):
      for pairs in zip(*self.tower_grads_and_vars):
        var = pairs[0][1]
        grads = [(h, g) for h, (g, _) in zip(self._healthy, pairs)
                 if g is not None]
        if not grads:
          averaged.append((None, var))
          continue
        with var.graph.colocate_with(var):
          averaged.append((self._average(grads), var))
    return averaged

  def _average(self, healthy_and_grads):
    """One variable's average over the healthy towers."""
    grads = [g for _, g in healthy_and_grads]
    if all(isinstance(g, tf.IndexedSlices) for g in grads):
      int64 = any(g.indices.dtype == tf.int64 for g in grads)
      indices = tf.concat([tf.cast(g.indices, tf.int64) if int64 else
                           g.indices for g in grads], axis=0)
      values = tf.concat([_select(h, g.values)
                          for h, g in healthy_and_grads], axis=0)
      dense_shape = next((g.dense_shape for g in grads
                          if g.dense_shape is not None), None)
      return tf.IndexedSlices(values * self._scale_for(values), indices,
                              dense_shape)
    kept = [_select(h, tf.convert_to_tensor(g)) for h, g in healthy_and_grads]
    total = kept[0] if len(kept) == 1 else tf.add_n(kept)
    return total * self._scale_for(total)

  def _scale_for(self, tensor):
    dtype = tensor.dtype.base_dtype
    return self._scale if dtype == tf.float32 else tf.cast(self._scale, dtype)


def _select(healthy, tensor):
  """`tensor` if `healthy`, else zeros: a select, so a NaN never leaks."""
  return tf.where(healthy, tensor, tf.zeros([], tensor.dtype.base_dtype))


def of_towers(params, outputs, variables_device, indices=None,
              outliers=None):
  """The step's `TowerUnit` with --skip_unit=tower and several towers, else
  None (one tower: leaving it out is skipping the step).

  Args:
    params: the run's `params.TrainParams`.
    outputs: each built tower's (loss, grads_and_vars, fused non-finite
      flag).
    variables_device: where the counters live.
    indices: the built towers' indices (default: all).
    outliers: optional bool [len(outputs)]: towers left out as outliers.
  """
  if params.skip_unit != "tower" or params.num_towers < 2:
    return None
  return TowerUnit([l for l, _, _ in outputs], [gv for _, gv, _ in outputs],
                   [f for _, _, f in outputs],
                   min_healthy(params.min_healthy_towers, params.num_towers),
                   variables_device, indices, params.num_towers, outliers)
