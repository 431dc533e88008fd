"""TensorBoard summaries that survive a skipped step.

`tf.compat.v1.summary.histogram` of a tensor holding a NaN or an Inf raises
"Nan in summary histogram" and kills the run, on exactly the steps the
wrapper skips (a gradient histogram sees the NaN gradient). `histogram`
records the finite values and counts the others in a scalar instead.
"""

import tensorflow as tf

from tf1_safe_train.core import skip_report

tf1 = tf.compat.v1


def histogram(name, values, collections=None, family=None):
  """A histogram of the finite values of `values`, and their non-finite count.

  Writes two summaries: `name`, the histogram of the finite elements (empty
  when none is finite), and `name + "/nonfinite_count"`, a scalar counting
  the NaN, +Inf and -Inf elements (0 on a good step).

  Args:
    name: the summary name, as for `tf.compat.v1.summary.histogram`.
    values: a float Tensor, or an `IndexedSlices` (its values), e.g. a
      gradient.
    collections: graph collections to add the summaries to; default
      `[GraphKeys.SUMMARIES]`.
    family: as for `tf.compat.v1.summary.histogram`.

  Returns:
    A scalar string tensor, the two summaries merged.
  """
  if isinstance(values, tf.IndexedSlices):
    values = values.values
  with tf1.name_scope(name + "_finite"):
    flat = tf.reshape(values, [-1])
    finite = tf.math.is_finite(flat)
    kept = tf.boolean_mask(flat, finite)
    nonfinite = tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int64))
  return tf1.summary.merge([
      tf1.summary.histogram(name, kept, collections=collections,
                            family=family),
      tf1.summary.scalar(name + "/nonfinite_count", nonfinite,
                         collections=collections, family=family),
  ])


def gradient_histograms(grads_and_vars, collections=None):
  """`histogram` of every gradient, named "<variable>/gradients".

  Args:
    grads_and_vars: (gradient, variable) pairs; `None` gradients are skipped.
    collections: as for `histogram`.

  Returns:
    A scalar string tensor, every summary merged.
  """
  merged = [histogram(v.op.name + "/gradients", g, collections=collections)
            for g, v in grads_and_vars if g is not None]
  return tf1.summary.merge(merged) if merged else tf.constant("")


def skip_reasons(optimizer, collections=None):
  """Scalars `skips/<reason>_skips` of the last step `optimizer` built.

  One per skip criterion (`skips/nonfinite_skips`, `skips/spike_skips`,
  a dry run's `skips/spike_would_skips`, ...), named as the trainer's.

  Args:
    optimizer: a `SkipNonFiniteOptimizer` after `apply_gradients`.
    collections: as for `histogram`.

  Returns:
    A scalar string tensor, the summaries merged.
  """
  return tf1.summary.merge([
      tf1.summary.scalar(tag, value, collections=collections)
      for tag, value in skip_report.reason_tags(
          optimizer.guard_result().reasons.counts).items()])
