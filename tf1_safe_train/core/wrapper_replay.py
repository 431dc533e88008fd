"""The wrapper's forensics: replay a feed dict; one skips.jsonl record per skip.

A plain `session.run` loop holds a skipped step's batch in NumPy, and the
skip left the weights as that step saw them: `opt.replay(session,
feed_dict)` replays the batch through the loss and gradients the wrapper saw
and names the first non-finite op (`replay.Probe`). `opt.report_hook(
skip_log_path=...)` appends the trainer's `skip_log` record for every
skipped step, with that replay when asked (`replay=True`).
"""

from absl import logging
import tensorflow as tf

from tf1_safe_train.core import op_walk
from tf1_safe_train.core import replay as replay_lib
from tf1_safe_train.core import skip_log
from tf1_safe_train.core import step_report
from tf1_safe_train.core import story

tf1 = tf.compat.v1


class SkipLogHook(step_report.StepReportHook):
  """`StepReportHook` that also appends each skip to a skips.jsonl file."""

  def __init__(self, report, check_fn, log_path, worker, device, probe,
               max_replays):
    super(SkipLogHook, self).__init__(report, check_fn)
    self._log_path = log_path
    self._worker = worker
    self._device = device
    self._probe = probe
    self._max_replays = max_replays
    self.replays = 0

  def _record(self, values, reason, **extra):
    return self._report.record(values, reason, self._device, self._worker,
                               **extra)

  def after_run(self, run_context, run_values):
    logged = len(self.reports)
    super(SkipLogHook, self).after_run(run_context, run_values)
    values = run_values.results
    if self._fetched and self._log_path is not None:
      for reason in self._report.would_skip(values):
        # Applied: a dry run's record says what would have been skipped.
        skip_log.append(self._log_path,
                        self._record(values, reason, dry_run=True))
    if len(self.reports) == logged:
      return  # Not fetched, or applied.
    record = self._record(values, self._report.label(values))
    feed_dict = run_context.original_args.feed_dict
    if self._probe is not None and self.replays < self._max_replays:
      if feed_dict:
        self.replays += 1
        try:
          finding = self._probe.run(run_context.session, feed_dict)
        except (ValueError, tf.errors.OpError) as e:
          # The replay explains a skip; it must not end the run.
          record["replay"] = {"error": str(e).splitlines()[0]}
          logging.warning("step %d replay failed: %s", record["step"],
                          record["replay"]["error"])
        else:
          record["replay"] = replay_lib.as_record(finding)
          logging.warning("step %d replay: %s", record["step"],
                          record["replay"]["summary"])
      elif not self.replays:
        self.replays = self._max_replays  # Say it once.
        logging.warning("replay: the skipped run had no feed_dict (an input "
                        "pipeline); a replay needs the batch fed: not "
                        "replayed")
    if self._log_path is not None:
      skip_log.append(self._log_path, record)


class Replay(object):
  """`SkipNonFiniteOptimizer`'s replay of a batch, and its skips.jsonl hook.

  The wrapper calls `note_step` with each step's losses and gradients.
  """

  def __init__(self, name, last_step, loss_scale=None):
    """Args: the wrapper's name, its `reporting.LastStep`, its loss scale
    (`loss_scale.DynamicLossScale` or None; the hook's start line names
    it)."""
    self._name = name
    self._last_step = last_step
    self.loss_scale = loss_scale
    self._replay_outputs = None
    self._probes = None
    self._default_probe = None

  def _built_report(self):
    return self._last_step.report()

  def check_train_op(self, train_op):
    """The last step's `check_train_op` (`reporting.LastStep`)."""
    return self._last_step.check_train_op(train_op)

  def note_step(self, losses, grads_and_vars):
    """Notes a step's losses and gradients: what a replay recomputes."""
    self._replay_outputs = list(losses) + [g for g, _ in grads_and_vars
                                           if g is not None]
    self._probes, self._default_probe = {}, None

  def build_replay(self, inputs=None):
    """Builds the replay of the last step's loss and gradients now.

    Needed before the graph is finalized (`MonitoredTrainingSession`
    finalizes it) when `replay` is called afterwards; `report_hook(
    replay=True)` calls it.

    Args:
      inputs: the tensors a replay feeds (the walk stops there); default:
        the placeholders the loss and gradients are computed from.

    Returns:
      The `replay.Probe`.

    Raises:
      ValueError: if `apply_gradients` (or `minimize`) has not been called.
    """
    self._last_step.get()  # Raises the usual error before any step.
    if inputs is None:
      inputs = op_walk.placeholders(self._replay_outputs)
    inputs = list(inputs)
    key = tuple(sorted(t.name for t in inputs))
    if key not in self._probes:
      self._probes[key] = replay_lib.Probe(inputs, self._replay_outputs,
                                           name=self._name + "_replay")
    self._default_probe = self._default_probe or self._probes[key]
    return self._probes[key]

  def replay(self, session, feed_dict):
    """Replays a batch through the last step's loss and gradients.

    After a skip (`describe_skip` returned a line, `applied()` was False)
    the weights are those the skipped step saw: the same feed dict, replayed
    now, recomputes the step and names where its NaN or Inf first appeared:

        print(opt.replay(sess, feed_dict))  # A replay.Finding, as one line:
        # input holds NaN/Inf: rows [3]; first non-finite: dense/MatMul
        # (forward)

    Nothing is trained. Stochastic ops (dropout) draw again, so a replay may
    differ from the step (see `replay`).

    Args:
      session: the `tf.compat.v1.Session` of the loop.
      feed_dict: the skipped step's feed dict.

    Returns:
      A `replay.Finding`.

    Raises:
      ValueError: before any `apply_gradients`, if the graph is finalized
        and `build_replay` was not called before, or if the feed dict lacks
        a placeholder the loss needs.
    """
    self._last_step.get()  # Raises the usual error before any step.
    graph = self._replay_outputs[0].graph if self._replay_outputs else None
    fed = [graph.as_graph_element(k) if isinstance(k, str) else k
           for k in feed_dict]
    fed = [t for t in fed if isinstance(t, tf.Tensor)]
    probe = self._probes.get(tuple(sorted(t.name for t in fed)))
    if probe is None:
      if graph is not None and not graph.finalized:
        probe = self.build_replay(fed)
      elif self._default_probe is not None:
        probe = self._default_probe
      else:
        raise ValueError(
            "replay: the graph is finalized; call opt.build_replay() before "
            "it is (e.g. before creating the MonitoredTrainingSession)")
    return probe.run(session, feed_dict)

  def report_hook(self, skip_log_path=None, worker=0, replay=False,
                  max_replays=10, batch_size=None):
    """A `SessionRunHook` that logs the report of every skipped step.

    For `MonitoredTrainingSession(hooks=[opt.report_hook()])`. It fetches
    only on runs that run the step, and checks (`check_train_op`) each new
    set of fetched ops before it runs. `reports` holds the lines logged.
    It also logs (INFO) a start line, what the step guards (its criteria,
    the loss scale, the towers it was told of), and a final line, what the
    session's runs of the step did (steps run, applied, skipped by reason,
    examples/sec or steps/sec, wall time, where skips.jsonl is), in
    //:train's words (`story`; `story.start_line`, `final_line`).

    Args:
      skip_log_path: optional skips.jsonl path (`skip_log.path(dir,
        worker)`): one record per skipped step, as the trainer writes
        (step, worker, time, reason, towers with index, device, nonfinite
        and variables).
      worker: the worker's task index, for the records.
      replay: also replay each skipped run's feed dict (`replay`) and add
        the finding to its record ("replay") and the log; builds the probe
        now. Runs without a feed dict (input pipelines) are not replayed.
      max_replays: replay at most this many skips (a long skip streak must
        not turn the run into a replay loop).
      batch_size: optional, the examples one run of the step trains on (all
        towers): the final line then says examples/sec, else steps/sec.
    """
    report = self._built_report()
    if skip_log_path is None and not replay:
      hook = step_report.StepReportHook(report, self.check_train_op)
    else:
      probe = self.build_replay() if replay else None
      device = next((t.device for t in self._replay_outputs if t.device), "")
      hook = SkipLogHook(report, self.check_train_op, skip_log_path, worker,
                         device, probe, max_replays)
    hook.story = story.WrapperStory(
        report.criteria, self.loss_scale, report.tower_devices, batch_size,
        skip_log_path)
    return hook
