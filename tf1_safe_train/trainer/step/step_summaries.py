"""TensorBoard scalars and histograms of the trainer's step.

No summary reads a gradient, so none can fail on a skipped step. The skip
counters are not sampled with the graph's summaries (every
--save_summaries_steps, which showed a 20-step run's skip at step 5 as
`skips/skipped_steps` = 0): `CountersHook` writes them from the values the
run's hooks fetch anyway, whenever one changes, at the run's first and
last step and every --save_summaries_steps, with a skip marker; a good
step that writes nothing executes no node more.
"""

import tensorflow as tf

from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.core import skip_report

tf1 = tf.compat.v1

# 1 at a skipped step, 0 at the other points the counters are written at:
# a spike next to the loss of the step that was skipped.
MARKER_TAG = skip_report.TAG_PREFIX + "skip_marker"
_SKIPPED = skip_report.TAG_PREFIX + "skipped_steps"
_APPLIED = skip_report.TAG_PREFIX + "applied_steps"


def add(step):
  """Adds the summaries of `step` (a `train_step.Step`) to the graph."""
  tf1.summary.scalar("loss", step.loss)
  tf1.summary.scalar("learning_rate", step.learning_rate)
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


def counters_hooks(step, params, strategy):
  """The run's `CountersHook` (the chief's: it writes the summaries)."""
  if not strategy.is_chief:
    return []
  return [CountersHook(step, params.train_dir, params.save_summaries_steps)]


class CountersHook(core_hooks.GatedHook):
  """Writes the skip counters' scalars when they change (`module doc`).

  Each point is stamped with global_step after the step, as the graph's
  summaries are (the loss of a step and its skip marker share a point): a
  skip at step 5 (the log's "skipped step 5") is at 6.
  """

  def __init__(self, step, summary_dir, every_n_steps):
    """Creates the hook.

    Args:
      step: the run's `train_step.Step` (its `totals`, read after it).
      summary_dir: where the run's events go.
      every_n_steps: also write this often (applied_steps, which every
        good step changes, is not written at each).
    """
    totals = step.totals
    by_tower = {"nonfinite_steps": totals["nonfinite_steps_by_tower"]}
    # --skip_unit=tower's "rejected", --skip_tower_outliers' "tower_outlier".
    by_tower.update(skip_report.tower_count_tags(totals))
    # --skip_unit=worker (the trainer imports no cluster module).
    by_worker = ({"rejected": totals["rejected_by_worker"]}
                 if "rejected_by_worker" in totals else {})
    # The same tensors `hooks.RunStatsHook` fetches: no node more.
    self._fetches = {"global_step": totals["global_step"],
                     "counters": totals["counters"],
                     "skip_reasons": totals["skip_reasons"],
                     "by_tower": by_tower, "by_worker": by_worker}
    self._summary_dir = summary_dir
    self._every_n = every_n_steps
    self._last = None  # (stamp, tags) of the last step run.
    self._written_at = None
    self.points = 0

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    results = run_values.results
    tags = skip_report.counter_tags(results["counters"],
                                    results["skip_reasons"],
                                    results["by_tower"],
                                    results["by_worker"])
    stamp = int(results["global_step"])
    previous = self._last[1] if self._last else None
    skipped = bool(previous) and tags[_SKIPPED] > previous[_SKIPPED]
    self._last = (stamp, tags)
    if (previous is None or skipped or self._skip_counts(tags) !=
        self._skip_counts(previous) or
        stamp - self._written_at >= self._every_n):
      self._write(stamp, tags, skipped)

  @staticmethod
  def _skip_counts(tags):
    # Every good step changes applied_steps: it alone writes nothing.
    return [v for k, v in tags.items() if k != _APPLIED]

  def _write(self, stamp, tags, skipped):
    writer = tf1.summary.FileWriterCache.get(self._summary_dir)
    writer.add_summary(tf1.Summary(value=[
        tf1.Summary.Value(tag=tag, simple_value=float(value))
        for tag, value in list(tags.items()) + [(MARKER_TAG, skipped)]]),
                       stamp)
    self._written_at = stamp
    self.points += 1

  def end(self, session):
    del session  # The last step's values were fetched with it.
    if self._last is not None and self._written_at != self._last[0]:
      self._write(self._last[0], self._last[1], False)
    if self._last is not None:
      tf1.summary.FileWriterCache.get(self._summary_dir).flush()
