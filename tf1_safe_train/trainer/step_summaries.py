"""TensorBoard scalars and histograms of the trainer's step.

No summary reads a gradient, so none can fail on a skipped step.
"""

import tensorflow as tf

from tf1_safe_train.core import reasons

tf1 = tf.compat.v1


def add(step):
  """Adds the summaries of `step` (a `train_step.Step`) to the graph."""
  tf1.summary.scalar("loss", step.loss)
  tf1.summary.scalar("learning_rate", step.learning_rate)
  for name, value in step.counters._asdict().items():
    tf1.summary.scalar("skips/" + name, value)
  # One scalar per reason (skips/nonfinite_skips, skips/spike_skips, ...).
  reasons.add_summaries(step.totals["skip_reasons"])
  by_tower = step.totals["nonfinite_steps_by_tower"]
  for i in range(len(step.report.tower_devices)):
    tf1.summary.scalar("skips/nonfinite_steps_tower_%d" % i, by_tower[i])
  rejected = step.totals.get("rejected_by_tower")  # --skip_unit=tower.
  for i in range(len(step.report.tower_devices) if rejected is not None
                 else 0):
    tf1.summary.scalar("skips/rejected_tower_%d" % i, rejected[i])
  if step.loss_scale is not None:
    # Tagged "loss_scale" exactly: tf1.summary.scalar would take the tag from
    # a new name scope, "loss_scale_1", as "loss_scale" holds the variable.
    tf1.add_to_collection(tf1.GraphKeys.SUMMARIES, tf.raw_ops.ScalarSummary(
        tags="loss_scale", values=tf.convert_to_tensor(step.loss_scale.scale),
        name="loss_scale_summary"))
  for v in tf1.trainable_variables():
    # Skipped steps never write NaN, but an applied step can (a learning rate
    # too large): the histogram must not fail the step that would report it.
    # (|x| <= max is exactly "finite"; IsFinite ops stay one per gradient.)
    values = tf.reshape(v, [-1])
    finite = tf.less_equal(tf.abs(values), v.dtype.base_dtype.max)
    tf1.summary.histogram("weights/" + v.op.name,
                          tf.boolean_mask(values, finite))
