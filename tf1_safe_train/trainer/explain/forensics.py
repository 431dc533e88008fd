"""Every skip explained while the run goes on: `ForensicsHook`.

After a skipped step (the weights are exactly as it saw them) the hook reads
each tower's stored batch, replays the offending tower's (`replay_lib`) and
appends one record to the worker's `skips.jsonl` (`core.skip_log`; a
cluster's non-chief worker also relays it to the chief's: `relay`): step,
worker, time, reason, towers (index, device, nonfinite, loss, example_ids,
batch_hash, variables), replay, verdict, seconds; a skip for another reason
(its criterion's label, e.g. "spike"), or a dry-run criterion's would-be
skip ("dry_run", on an applied step), has the criterion's values instead of
a replay (but for a tower --skip_unit=tower left out for a NaN/Inf in that
step: replayed as any non-finite fault, the record has both reasons; and
for a tower --skip_tower_outliers named: replayed for its gradient norm,
`outlier_replay`). It logs one line and writes a TensorBoard text and
scalar.

Replays are rate-limited (`max_explained`, per run: a skip streak must not
turn the run into a replay loop); a skip past the limit still gets its
record, with the stored batch but no replay. Each explained skip also saves
what `//:replay` needs to re-run it offline: `<train_dir>/skips/step-N-K/`
(a checkpoint of the state the step saw, its batches, the run's params;
`skip_states` names and prunes them).

The hook must run before the checkpoint saver's `after_run` (train_lib
passes it as a first hook): a checkpoint covering the step is then written
only after its record, so a SIGKILL in between loses nothing (the restart
re-runs the step and its skip appends a record of its own).
"""

import collections
import os
import time

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.core import reasons as reasons_lib
from tf1_safe_train.core import skip_log
from tf1_safe_train.core import skip_report
from tf1_safe_train.core import tower_outliers
from tf1_safe_train.trainer.inputs import batch_store
from tf1_safe_train.trainer.explain import outlier_replay
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.explain import skip_states
from tf1_safe_train.trainer.explain import verdict_counts

tf1 = tf.compat.v1

SKIPS_DIR = skip_states.SKIPS_DIR
load_batches = skip_states.load_batches  # (Its old home.)
BATCH_FILE = skip_states.BATCH_FILE
PARAMS_FILE = skip_states.PARAMS_FILE
CHECKPOINT_PREFIX = skip_states.CHECKPOINT_PREFIX
NOT_EXPLAINED = "not explained: --max_explained_skips reached"
# A finite skip (a spike, another criterion's) is no fault to find: its values
# are in the record, and a replay (finite by construction) would only call it
# "not reproducible" and accuse a device, or worse, exclude its examples.
FINITE = verdict_counts.FINITE
SPIKE = FINITE % "spike"
# The tower-agreement criterion's reason.
OUTLIER = tower_outliers.REASON
DRY_RUN = "%s would be skipped (dry run: applied; not replayed)"
OVERFLOW = ("loss-scale overflow at scale %s (expected: the scale halves); "
            "not replayed")
LOSS_SCALE_FLOOR = 1.0  # The dynamic loss scale's (hooks.SkipReportHook's).


class ForensicsHook(core_hooks.GatedHook):
  """Records, replays and classifies every skipped step of this worker."""

  def __init__(self, step, params, worker=0, max_explained=10,
               summary_dir=None, describe_id=str, on_model=None,
               quarantine=None, relay=None):
    """Creates the hook.

    Args:
      step: the run's `train_step.Step` (its `forensics`, report, applied).
      params: the run's `params.TrainParams` (saved with each skip).
      worker: this worker's index (its own log and skip directories).
      max_explained: replays this run at most (0: none, records only).
      summary_dir: if set, TensorBoard gets each explained skip there.
      describe_id: example id -> its human name (`data.describe_id`).
      on_model: `on_model(run_context, step)`, called after the record of a
        "the model, not the data" verdict (e.g. stop or roll back now);
        True if it stopped the run (`model_fault` is then the step).
      quarantine: optional `quarantine.Quarantine` (suspect devices).
      relay: a non-chief worker's `send(session, record)` (the cluster's
        `skip_relay.SkipRelay`): each record also goes to the chief's log.

    Raises:
      ValueError: the hook may replay (`max_explained` or `quarantine`) a
        step built without probes (`replay_lib.Forensics.replays`).
    """
    if (max_explained or quarantine) and not step.forensics.replays:
      raise ValueError("ForensicsHook: max_explained=%d%s, but the step was "
                       "built without replay probes" % (
                           max_explained, " and a quarantine" if quarantine
                           else ""))
    self._forensics = step.forensics
    report = step.report
    self._fetches = {"step": step.step_index, "applied": step.applied,
                     "towers": report.tower_flags,
                     "average": report.average_flags,
                     "losses": {i: t.loss for i, t in enumerate(
                         self._forensics.towers) if t is not None}}
    if step.loss_scale_before is not None:
      self._fetches["scale"] = step.loss_scale_before
    self._reasons = step.reasons
    if step.reasons is not None:
      self._fetches["criteria"] = step.reasons.fetches
    if step.tower_unit is not None:  # Towers left out: recorded too.
      self._fetches["left_out"] = step.tower_unit.any_left_out
    # --skip_unit=worker: this worker's push was left out, not the step
    # skipped (the chief's line says whether the others' applied).
    self._worker_unit = step.worker_unit is not None
    # --skip_tower_outliers: the towers it names (left out or skipped).
    self._outliers = next((c for c in (step.reasons.criteria if step.reasons
                                       else []) if c.reason == OUTLIER and
                           not c.dry_run), None)
    # Its outliers replayed (`outlier_replay`): their norms were built.
    self._built = [t.index for t in self._forensics.towers if t is not None]
    self._outlier_replays = bool(self._outliers) and all(
        self._forensics.towers[t].grad_norm is not None for t in self._built)
    self._names = list(report.variable_names)
    self._devices = list(report.tower_devices)
    self._params = params
    self._worker = worker
    self._max_explained = max_explained
    self._summary_dir = summary_dir
    self._describe_id = describe_id
    self.records = 0
    self.explained = 0
    self.replay_seconds = []
    self.verdicts = collections.Counter()
    self.suspect_devices = collections.Counter()
    self._on_model = on_model
    self._quarantine = quarantine
    self._relay = relay
    self.model_fault = None  # The model verdict's step that stopped the run.

  def after_run(self, run_context, run_values):
    results = run_values.results
    if not self._fetched:
      return
    left_out = bool(results.get("left_out"))  # --skip_unit=tower.
    if results["applied"]:
      for would in (self._reasons.would_skip(results["criteria"])
                    if self._reasons else []):
        self._record_dry_run(run_context, results, would.reason)
      if not left_out:
        return
    started = time.time()
    batches = self._batches(run_context.session)
    flags = [bool(f) for f in np.reshape(results["towers"], [-1])]
    reason = (self._reasons.label(results["criteria"]) if self._reasons
              else reasons_lib.NONFINITE)
    outliers = (self._outliers.outlier_towers(
        results["criteria"]["values"][OUTLIER]) if self._outliers else None)
    if outliers and not any(flags):  # Left out (applied) or skipped.
      reason = OUTLIER
    record = skip_report.record(int(results["step"]), self._worker, reason,
                                towers=self._towers(results, flags, batches,
                                                    outliers))
    if left_out and results["applied"]:  # Replayed on the weights after.
      record.update(unit="tower", weights="after the step")
    elif self._worker_unit:
      record["unit"] = "worker"
    if "scale" in results:
      record["loss_scale"] = float(results["scale"])
    offending = [t for t, f in enumerate(flags) if f]
    # A flagged tower whose input holds NaN/Inf first: that alone is
    # evidence of data, whatever the weights (the record replays one).
    offending.sort(key=lambda t: bool(np.isfinite(batches[t][0]).all()))
    text = self._verdict(run_context, record, offending, batches, flags,
                         results.get("criteria"))
    if reason != reasons_lib.NONFINITE and offending:
      text = self._both_reasons(record, reason, results["criteria"], text)
    record["seconds"] = round(time.time() - started, 4)
    self._append(run_context, record, text)

  def _verdict(self, run_context, record, offending, batches, flags,
               criteria):
    """Sets the record's verdict (a fault's: replayed); returns its line."""
    step, reason = record["step"], record["reason"]
    scale = record.get("loss_scale")
    # A tower --skip_tower_outliers named (no NaN/Inf tower in the step),
    # if its replay was built (3 towers or more): replayed for its norm.
    outlier = (outlier_replay.named(self._outliers, criteria["values"][
        reason], self._built) if reason == OUTLIER and not offending and
               self._outlier_replays else None)
    if outlier is not None:
      tower, band = outlier
      record.update(skip_report.criterion_fields(self._reasons, reason,
                                                 criteria))
      if self._past_limit(tower):
        record["verdict"] = NOT_EXPLAINED
        return "step %d tower %d: %s" % (step, tower, NOT_EXPLAINED)
      return self._replay(run_context, record, tower, batches,
                          lambda session: outlier_replay.explain(
                              session, self._forensics, tower, batches,
                              band, scale, self._name))
    if reason != reasons_lib.NONFINITE and not offending:
      # (The non-finite criterion comes first: a NaN step is labelled so;
      # a tower left out for a NaN is no reason of the decision, so a
      # spike of the rest labels its step: both reasons, `_both_reasons`.)
      record.update(verdict=FINITE % reason,
                    **skip_report.criterion_fields(self._reasons, reason,
                                                   criteria))
      self.verdicts[reason] += 1
    elif scale is not None and scale > LOSS_SCALE_FLOOR:
      # fp16: the scale halves and the step is retried on other data; a
      # replay would reproduce the overflow and exclude good examples.
      record["verdict"] = OVERFLOW % skip_report.format_scale(scale)
    elif not offending:
      # E.g. sync replicas: another worker's gradients were non-finite.
      record["verdict"] = "no tower of this worker was non-finite"
    elif self._past_limit(offending[0]):
      record["verdict"] = NOT_EXPLAINED
      return "step %d tower %d: %s" % (step, offending[0], NOT_EXPLAINED)
    else:
      return self._replay(run_context, record, offending[0], batches,
                          lambda session: replay_lib.explain(
                              session, self._forensics, offending[0],
                              batches[offending[0]], scale, flags))
    return "step %d: %s" % (step, record["verdict"])

  def _past_limit(self, tower):
    """Whether `tower`'s fault gets no replay: --max_explained_skips
    reached, and no --quarantine_after replay is due to it."""
    return self.explained >= self._max_explained and not (
        self._quarantine and self._quarantine.wants_replay(tower))

  def _replay(self, run_context, record, tower, batches, explain):
    """Replays `tower`'s fault (`explain(session)`: `replay_lib.explain`'s
    parts), saves the state for //:replay; its line."""
    self.explained += 1
    session, step = run_context.session, record["step"]
    explained = explain(session)
    record.update(explained)
    replayed = record["replay"]
    replayed["input_examples"] = [self._name(i)
                                  for i in replayed["input_ids"]]
    record["replay_seconds"] = record.pop("seconds")
    skip_states.save_into(record, self._params, self._worker, batches,
                          self._forensics.saver, session,
                          self._max_explained)
    self.replay_seconds.append(record["replay_seconds"])
    self.verdicts[verdict_counts.verdict_key(explained)] += 1
    if explained["suspect_device"]:
      self.suspect_devices[explained["suspect_device"]] += 1
      if self._quarantine:
        self._quarantine.on_suspect(run_context, tower)
    return replay_lib.line(step, explained)

  def _append(self, run_context, record, text):
    """Appends the record; logs, acts on and summarizes its line."""
    step = record["step"]
    # Before the checkpoint saver's after_run: see the module doc.
    self._write(run_context, record)
    logging.warning("%s", text)
    if (record.get("verdict") == replay_lib.MODEL and
        self._on_model is not None and self._on_model(run_context, step)):
      self.model_fault = step
    self._summarize(step, text, bool(record.get("reproduced")),
                    record["seconds"])

  def _write(self, run_context, record):
    """Appends `record` to this worker's log, then relays it (a cluster's
    non-chief worker: its --train_dir need not be the chief's)."""
    skip_log.append(skip_log.path(self._params.train_dir, self._worker),
                    record)
    self.records += 1
    if self._relay is not None:
      self._relay.send(run_context.session, record)

  def _both_reasons(self, record, reason, criteria, text):
    """A finite criterion's skip (a spike) of a step whose towers
    --skip_unit=tower left out for a NaN/Inf: the record, explained as a
    non-finite fault (its verdict, replay, exclusion), gets the
    criterion's values and `reasons` (both); returns the line of both."""
    record.update(reasons=[reasons_lib.NONFINITE, reason],
                  **skip_report.criterion_fields(self._reasons, reason,
                                                 criteria))
    self.verdicts[reason] += 1
    rest = text[len("step %d" % record["step"]):]
    return "step %d: %s; %s" % (record["step"], FINITE % reason,
                                rest[2:] if rest.startswith(": ")
                                else rest.lstrip())

  def _batches(self, session):
    return [self._forensics.store.read(session, t)
            for t in range(self._forensics.store.num_towers)]

  def _record_dry_run(self, run_context, results, reason):
    """The record of a dry-run criterion's would-be skip (the step was
    applied; the line is `hooks.SkipReportHook`'s): its values, the
    towers' batches, no replay."""
    towers = self._towers(results, [False] * len(self._devices),
                          self._batches(run_context.session))
    self._write(run_context, skip_report.record(
        results["step"], self._worker, reason, self._reasons,
        results["criteria"], dry_run=True, towers=towers,
        verdict=DRY_RUN % reason))
    self.verdicts[reason + "_would_skip"] += 1

  def _name(self, example_id):
    """The example's name; its id if the source cannot name it (a skip's
    explanation never ends the run)."""
    try:
      return self._describe_id(example_id)
    except ValueError:
      return str(example_id)

  def _towers(self, results, flags, batches, outliers=None):
    """The record's per-tower entries (`outliers`: the towers named by
    --skip_tower_outliers)."""
    # A NaN/Inf of any tower survives averaging: the decision's variables
    # are those of the flagged towers.
    variables = [n for n, f in zip(self._names, results["average"]) if f]

    def extra(t):
      images, labels, ids = batches[t]
      return {"loss": float(results["losses"][t]),
              "example_ids": [int(i) for i in ids],
              "batch_hash": batch_store.batch_hash(images, labels)}

    return skip_report.towers(
        self._devices, flags, variables, extra,
        [t for t in range(len(batches))
         if self._forensics.towers[t] is not None],  # Not quarantined.
        outliers)

  def _summarize(self, step, text, reproduced, seconds):
    if not self._summary_dir:
      return
    writer = tf1.summary.FileWriterCache.get(self._summary_dir)
    text_value = tf1.Summary.Value(tag="skips/explained")
    text_value.metadata.plugin_data.plugin_name = "text"
    text_value.tensor.CopyFrom(tf.make_tensor_proto(np.array(text.encode())))
    writer.add_summary(tf1.Summary(value=[
        text_value,
        tf1.Summary.Value(tag="skips/reproduced",
                          simple_value=float(reproduced)),
        tf1.Summary.Value(tag="skips/explain_seconds",
                          simple_value=seconds)]), step)

  def summary(self):
    """The run summary's "forensics" fields of this worker."""
    seconds = self.replay_seconds
    return {
        "skip_records": self.records, "explained_skips": self.explained,
        "verdicts": dict(self.verdicts),
        "suspect_devices": dict(self.suspect_devices),
        "replay_seconds_mean": (round(sum(seconds) / len(seconds), 4)
                                if seconds else None),
        "replay_seconds_max": max(seconds) if seconds else None}
