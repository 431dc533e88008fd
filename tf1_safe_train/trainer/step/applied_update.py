"""The update of an applied step: clip, apply, statistics, EMA.

What the trainer's guarded step (`train_step.build_step`) wraps in
`optimizer.SkipNonFiniteOptimizer`: the wrapper's decision calls
`AppliedUpdate.apply_gradients` inside its apply branch, so none of it runs
on a skipped step.
"""

import tensorflow as tf

from tf1_safe_train.core import rollback
from tf1_safe_train.trainer.step import optimization

tf1 = tf.compat.v1


class AppliedUpdate(tf1.train.Optimizer):
  """The update of an applied step: clip, apply, statistics, EMA.

  What `optimizer.SkipNonFiniteOptimizer` wraps for the trainer: the
  wrapper's decision calls `apply_gradients` inside its apply branch.
  """

  def __init__(self, params, optimizer, statistics, applied_steps):
    super(AppliedUpdate, self).__init__(use_locking=False, name="update")
    self._params = params
    self._optimizer = optimizer
    self._statistic_ids = set(id(v) for _, v in statistics)
    self._statistics = [v for _, v in statistics]
    self._applied_steps = applied_steps

  def _create_slots(self, var_list):
    # pylint: disable=protected-access
    self._optimizer._create_slots(
        [v for v in var_list if id(v) not in self._statistic_ids])

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del global_step, name  # The wrapper advances it; the guard names.
    params, ids = self._params, self._statistic_ids
    model_pairs = [(g, v) for g, v in grads_and_vars if id(v) not in ids]
    if params.clip_gradient_norm:
      model_pairs, _ = optimization.clip_by_global_norm(
          model_pairs, params.clip_gradient_norm)
    update = self._optimizer.apply_gradients(model_pairs)
    if self._statistics:
      writes = [v.assign_sub(d, read_value=False)
                for d, v in grads_and_vars if id(v) in ids]
      with tf1.control_dependencies([update] + writes):
        # Shadows as on one machine, so checkpoints stay interchangeable.
        update = rollback.Rollback(self._statistics).commit()
    if not params.moving_average_decay:
      return update
    ema = tf1.train.ExponentialMovingAverage(
        params.moving_average_decay, num_updates=self._applied_steps)
    with tf1.control_dependencies([update]):
      return ema.apply(tf1.trainable_variables())
