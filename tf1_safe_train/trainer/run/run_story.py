"""What a training run says it is about to do, and what it did.

`log_start` logs the start banner (model, towers and their devices, batch,
precision, the skip criteria and unit, drills, fresh or resumed, train_dir),
as tf_cnn_benchmarks' `print_info` does; `log_end` logs one final line
(steps applied and skipped by reason, final loss, examples/sec over the run
like its "total images/sec", where run_summary.json is) at the end of every
run, however short.
"""

import os
import re

from absl import logging

from tf1_safe_train.core import reasons
from tf1_safe_train.core import story
from tf1_safe_train.trainer.run import run_summary

_RULE = "=========="


def banner(params, tower_devices, variables_device, criteria, resume,
           num_workers=1, worker_index=0, is_chief=True, quarantined=()):
  """The start banner's lines (label, value), in order.

  Args:
    params: the run's `params.TrainParams`.
    tower_devices: this worker's towers' device strings.
    variables_device: where the variables live (a device string; anything
      else, e.g. a cluster's device function, is not shown).
    criteria: the step's skip criteria (`criteria.Criterion`s), or None
      where the chief decides (sync replicas).
    resume: the checkpoint path the run resumes from, or None (fresh).
    num_workers, worker_index, is_chief: this worker in its cluster.
    quarantined: indices of towers the step was built without.

  Returns:
    A list of (label, text) pairs.
  """
  towers = ", ".join(
      d + (" (tower %d quarantined)" % i if i in quarantined else "")
      for i, d in enumerate(tower_devices))
  towers = "%d (%s)" % (len(tower_devices), towers)
  if isinstance(variables_device, str) and variables_device:
    towers += "; variables on %s" % variables_device
  # A quarantined tower reads no input.
  per_step = params.batch_size * (len(tower_devices) - len(quarantined))
  batch = "%d per tower, %d per step" % (params.batch_size, per_step)
  lines = [("Model", "%s on %s, %s optimizer, learning rate %g (%s)" % (
      params.model, params.dataset, params.optimizer, params.learning_rate,
      params.lr_schedule))]
  if num_workers > 1:
    lines.append(("Worker", "%d of %d%s, %s replicas" % (
        worker_index, num_workers, " (chief)" if is_chief else "",
        "synchronous" if params.sync_replicas else "asynchronous")))
    # Asynchronous workers each apply their own steps.
    batch += (", %d per step of all %d workers" % (per_step * num_workers,
                                                   num_workers)
              if params.sync_replicas else ", on each worker")
  lines += [
      ("Towers", towers),
      ("Batch size", batch),
      ("Precision", _precision(params)),
      ("Skip when", "; ".join(_criteria(params, criteria))),
      ("Skip unit", _unit(params)),
      ("Give up", _give_up(params)),
      ("Drills", _drills(params)),
      ("Steps", _start(params, resume, is_chief)),
      ("Train dir", params.train_dir),
  ]
  return lines


def log_start(params, step, strategy, resume, quarantine=None):
  """Logs the `banner` of a run about to run `step` (`train_step.Step`) as
  `strategy` places it (`quarantine`: its `quarantine.Quarantine` or None),
  one line per label, then a rule."""
  quarantined = quarantine.quarantined if quarantine else ()
  for label, text in banner(
      params, step.report.tower_devices,
      strategy.tower_config.variables_device(),
      step.reasons.criteria if step.reasons else None, resume,
      strategy.num_workers, strategy.worker_index, strategy.is_chief,
      quarantined):
    logging.info("%-12s%s", label + ":", text)
  logging.info(_RULE)


def _precision(params):
  if params.precision == "fp16":
    return "fp16, dynamic loss scale from %g" % params.initial_loss_scale
  return params.precision


def _unit(params):
  if params.skip_unit == "tower":
    text = ("tower: a faulty tower left out, the others applied (the step "
            "skipped below %d healthy)" % params.min_healthy_towers)
  elif params.skip_unit == "worker":
    text = ("worker: a faulty worker's push left out, the others' applied "
            "(the step skipped below %s healthy workers)" % (
                params.min_healthy_workers or "half the"))
  else:
    text = "step: nothing applied"
  if params.quarantine_after:
    text += ", a %s quarantined after %d unreproduced faults" % (
        "worker" if params.skip_unit == "worker" else "device",
        params.quarantine_after)
  return text


def _criteria(params, criteria):
  """One phrase per criterion: non-finite always, the others by reason."""
  words = [story.NONFINITE_PHRASE]
  names = ([c.reason for c in criteria if c.reason != reasons.NONFINITE]
           if criteria is not None else
           (["spike"] if params.skip_spikes_sigma else []))
  dry = {c.reason for c in criteria or () if c.dry_run}
  for name in names:
    if name == "spike" and params.skip_spikes_sigma:
      phrase = "spike: gradient norm%s over %g sigma (after %d steps)" % (
          " or loss" if params.skip_loss_spikes else "",
          params.skip_spikes_sigma, params.spike_warmup_steps)
    elif name == "tower_outlier" and params.skip_tower_outliers:
      phrase = ("tower_outlier: a tower's gradient norm against the "
                "others' over %g sigma and %gx (after %d steps)" % (
                    params.skip_tower_outliers,
                    params.skip_tower_outliers_min_factor,
                    params.skip_tower_outliers_warmup_steps))
    else:
      phrase = name
    words.append(phrase + (story.DRY_RUN
                           if name in dry or (name == "spike" and
                                              params.spike_dry_run) else ""))
  return words


def _give_up(params):
  then = ("roll back" if params.on_persistent_skips == "rollback"
          else "stop")
  return "after %d consecutive skips, %s" % (params.max_consecutive_skips,
                                             then)


def _drills(params):
  if not params.inject_nonfinite:
    return "none"
  return "%s, into the %s" % (params.inject_nonfinite, params.inject_into)


def _start(params, resume, is_chief):
  if not is_chief:
    return "from the chief's checkpoint, if any, to step %d" % (
        params.max_steps)
  if resume is None:
    return "a fresh run, steps 1 to %d" % params.max_steps
  step = re.search(r"-(\d+)$", resume)
  return "resumed from step %s (%s), to step %d" % (
      step.group(1) if step else "?", os.path.basename(resume),
      params.max_steps)


def summary_line(summary, train_dir=None):
  """The final line of a run from its run summary dict.

  Args:
    summary: what `run_summary.json` holds (`run_summary.build`).
    train_dir: where run_summary.json was written, or None (not by this
      process: a cluster's non-chief worker).

  Returns:
    One line, e.g. "run ended at step 10 (max_steps): 10 steps run,
    applied 9, skipped 1 (nonfinite 1), final loss 2.2931, total
    examples/sec 512.31, wall 3.2 s; run summary: <train_dir>/run_summary.json".
  """
  head = "run ended at step %s (%s): " % (summary.get("global_step"),
                                          summary.get("exit_reason"))
  run = summary.get("steps_this_run", 0)
  if not run:
    words = ["no step run"]
  else:
    # A cluster's worker counts its own runs of the step; others' add up.
    words = story.steps_words(
        run, summary.get("applied_steps"), summary.get("skipped_steps"),
        summary.get("skips_by_reason") or {}, "cluster" in summary)
    left_out = summary.get("rejected_by_tower")
    if left_out is not None:
      words.append("towers left out %d (by tower %s)" % (
          sum(left_out), left_out))
    if summary.get("quarantined_towers"):
      words.append("quarantined towers %s" % summary["quarantined_towers"])
    words += ["final loss %.4f" % summary.get("final_loss", float("nan")),
              story.rate_words(summary.get("examples_per_sec"))]
  words.append(story.wall_words(summary.get("wall_seconds", 0.0)))
  where = (os.path.join(train_dir, run_summary.RUN_SUMMARY) if train_dir
           else "written by the chief")
  return head + ", ".join(words) + "; run summary: " + where


def log_end(summary, train_dir=None):
  """Logs `summary_line(summary, train_dir)`."""
  logging.info("%s", summary_line(summary, train_dir))
