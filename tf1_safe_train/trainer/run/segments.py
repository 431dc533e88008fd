"""What outlives a segment of one process's run (`train_lib.train`).

A tower quarantined ends a segment: the step is rebuilt without it, in a
new graph, from the checkpoint the segment's end saved (`quarantine`). The
process stays one run across the rebuild:
- **The input goes on**: the startup exclusion is the process's (only a
  restart drops more examples from the input), and the rebuilt input
  starts past every batch the earlier segments' towers read
  (`batches_read`): the same seeded stream, so the towers' next batches
  are the next in the input and no example is fed twice in an epoch.
  The skipped batches are made again once (tf.data's `skip`), which costs
  far less than the steps that read them.
- **A signal is never lost**: the stop hook is installed by the first
  segment's steps and stays installed through the rebuild (a signal would
  otherwise kill the process with no line, or be forgotten with the
  segment's hook), so SIGTERM or Ctrl-C at the decision or during the
  rebuild stops the run as at any other point: no further segment, the
  final checkpoint written, exit reason "interrupted".
"""

from absl import logging

from tf1_safe_train import data
from tf1_safe_train.trainer.inputs import exclusion
from tf1_safe_train.trainer.run import stop_signals


def _excluded_examples(params, dataset_fn):
  """(ids the input drops, counts by reason): the startup exclusion."""
  exclude_ids, excluded = exclusion.excluded(
      params.train_dir if params.exclude_reproducible_skips else None,
      None if dataset_fn else lambda: data.split_ids(
          params.dataset, "train", params.data_dir), params.batch_size)
  line = exclusion.describe(excluded)
  if line:
    logging.info(line)
  return exclude_ids, excluded


class Segments(object):
  """The state one process's segments share.

  Attributes:
    exclude_ids: the example ids every segment's input drops.
    excluded: their counts by reason (the run summary's).
    batches_read: batches the towers of the finished segments read.
    on_signal: the run's `stop_signals.StopOnSignalHook`.
    run: the current segment's hooks (`train_lib`), whose summary a second
      signal's abort writes.
  """

  def __init__(self, params, strategy, dataset_fn):
    self.exclude_ids, self.excluded = _excluded_examples(params, dataset_fn)
    self.batches_read = 0
    self.run = None
    self._installed = False
    self.on_signal = stop_signals.StopOnSignalHook(
        on_abort=lambda reason: strategy.is_chief and (
            stop_signals.write_abort_summary(
                params.train_dir, self.run.summary("aborted"), reason)),
        liveness=strategy.liveness,
        stop_grace_secs=strategy.stop_grace_secs)

  def install_signals(self):
    """Installs the stop hook's handlers (once: the first segment's)."""
    if not self._installed:
      self.on_signal.install()
      self._installed = True

  def uninstall_signals(self):
    """Removes them (at the run's end: a segment about to be rebuilt keeps
    them); a further signal then only logs."""
    if self._installed:
      self.on_signal.uninstall()
      self._installed = False

  def segment_ended(self, steps_run, towers_built, rebuild):
    """Counts a segment's reads; returns whether the run goes on with a
    rebuilt step (`rebuild` asked and no signal stopped the run)."""
    self.batches_read += steps_run * towers_built
    return rebuild and not self.on_signal.interrupted
