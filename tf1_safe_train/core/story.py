"""A run's first and last lines, in the words //:train and the wrapper share.

//:train's banner and final line (`trainer/run/run_story.py`) and the
wrapper's `report_hook` (`WrapperStory`) say what a run guards and what it
did in these words: "skip when gradients, loss or statistics hold NaN/Inf",
"10 steps run, applied 9, skipped 1 (nonfinite 1)", "total examples/sec
512.31", "wall 3.2 s". A word changed here changes both.
"""

import time

from absl import logging

from tf1_safe_train.core import criteria as criteria_lib
from tf1_safe_train.core import skip_report

NONFINITE_PHRASE = "gradients, loss or statistics hold NaN/Inf"
DRY_RUN = " (dry run: reported, applied)"


def criteria_phrases(criteria, phrase=None):
  """One phrase per criterion: `NONFINITE_PHRASE` first, then each other
  criterion's `phrase(criterion)` (default: its reason), a dry run's with
  `DRY_RUN`."""
  words = [NONFINITE_PHRASE]
  for c in criteria:
    if c.reason != criteria_lib.NONFINITE:
      words.append((phrase(c) if phrase else c.reason) +
                   (DRY_RUN if c.dry_run else ""))
  return words


def steps_words(run, applied, skipped, by_reason, by_this_worker=False):
  """["10 steps run", "applied 9", "skipped 1 (nonfinite 1)"]: the steps
  this run ran, applied and skipped (`by_reason`: {reason: count})."""
  reasons = ", ".join("%s %d" % (r, n) for r, n in sorted(by_reason.items())
                      if n)
  return ["%d step%s run%s" % (run, "" if run == 1 else "s",
                               " by this worker" if by_this_worker else ""),
          "applied %s" % applied,
          "skipped %s%s" % (skipped, " (%s)" % reasons if reasons else "")]


def rate_words(rate, unit="examples"):
  """"total examples/sec 512.31" (tf_cnn_benchmarks' "total images/sec"),
  or "total steps/sec ..." when the examples per step are not known."""
  return "total %s/sec %s" % (unit, "%.2f" % rate if rate else "-")


def wall_words(seconds):
  return "wall %.1f s" % seconds


class WrapperStory(object):
  """The wrapper's run told in two lines: what it guards, what it did.

  `report_hook` owns one: `begin` logs the start line, `count` notes each
  run of the step its hook fetched (applied, or skipped and why), `end`
  logs the final line. The counts are this session's runs of the step, as
  the hook saw them (a resume's earlier steps are not among them).
  """

  def __init__(self, criteria, loss_scale, tower_devices, batch_size=None,
               skip_log_path=None):
    """Creates the run's lines.

    Args:
      criteria: the step's criteria (`reasons.Report.criteria`), or None.
      loss_scale: the wrapper's `loss_scale.DynamicLossScale`, or None.
      tower_devices: the towers' devices the wrapper was told of ("" if
        unknown), or [] (no towers given).
      batch_size: examples one run of the step trains on (all towers), for
        examples/sec; None: steps/sec.
      skip_log_path: where the hook writes skips.jsonl, or None.
    """
    guard = criteria_phrases(criteria or [])
    scale = ("dynamic from %s" % skip_report.format_scale(
        loss_scale.initial_scale) if loss_scale is not None else "none")
    towers = ("%d (%s)" % (len(tower_devices), ", ".join(
        d or "device not known" for d in tower_devices))
              if tower_devices else "not given (tower_grads_and_vars=)")
    self.start_line = "skip guard: skip when %s; loss scale %s; towers %s%s" % (
        "; ".join(guard), scale, towers, self._where(skip_log_path))
    self.final_line = None
    self._batch_size = batch_size
    self._skip_log_path = skip_log_path
    self._started = self._first = None
    self._run = self._applied = 0
    self._by_reason = {}

  @staticmethod
  def _where(skip_log_path):
    return "; skip records: %s" % skip_log_path if skip_log_path else ""

  def begin(self):
    self._started = time.time()
    self._first = None
    self._run = self._applied = 0
    self._by_reason = {}
    logging.info("%s", self.start_line)

  def count(self, reason):
    """Notes a run of the step: `reason` its skip's label, None if applied."""
    if self._first is None:
      self._first = time.time()  # The first run builds and warms up: untimed.
    self._run += 1
    if reason is None:
      self._applied += 1
    else:
      self._by_reason[reason] = self._by_reason.get(reason, 0) + 1

  def end(self):
    """Logs (and returns) the final line."""
    now = time.time()
    timed = self._run - 1
    rate = (timed / (now - self._first)
            if timed > 0 and now > self._first else None)
    unit = "steps"
    if rate and self._batch_size:
      rate, unit = rate * self._batch_size, "examples"
    elif self._batch_size:
      unit = "examples"
    words = steps_words(self._run, self._applied,
                        self._run - self._applied, self._by_reason)
    words += [rate_words(rate, unit),
              wall_words(now - (self._started or now))]
    self.final_line = "run ended: %s%s" % (", ".join(words),
                                           self._where(self._skip_log_path))
    logging.info("%s", self.final_line)
    return self.final_line
