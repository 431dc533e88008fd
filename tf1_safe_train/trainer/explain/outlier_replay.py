"""A tower left out as an outlier, explained: its batch replayed on another
tower's device, the data or the device.

The tower-agreement criterion (`--skip_tower_outliers`, reason
`tower_outlier`) leaves out (or skips the step for) a tower whose gradient
norm is too large for its batch, by the other towers; nothing of it is
non-finite, so the NaN probes (`replay_lib`) see nothing. `explain`
replays, on the same weights, each other tower's stored batch on its own
device and the outlier's batch on another tower's device (never its own),
and compares the batch's norm with what the others make of it (the
criterion's statistic, `tower_outliers.log_excess_np`) against the band
the step allowed that tower (`band`: up to its usual ratio times the
criterion's threshold):
  * outside it again -> the batch carries it: "reproducible: the data",
    its examples named, and excluded only on the evidence rule's terms:
    another batch passes on the same weights, here the other towers'
    batches agreeing among themselves (each within the band's width by
    the rest); if they do not, nothing is excluded (undecided);
  * within it -> the step's norm did not come back: "not reproducible:
    suspect <its device>", counted as a non-finite fault that did not
    reproduce (the same per-tower count `--quarantine_after` reads).
Under --skip_unit=tower the other towers' average was applied, so the
replays run on the weights after the step (the record says so), the
batch and its reference alike.
"""

import math
import time

import numpy as np

from tf1_safe_train.core import tower_outliers
from tf1_safe_train.trainer.explain import replay_lib


def band(criterion, values, position):
  """The step's ratios within which the tower at `position` (of the built
  towers) was no outlier: (low, high), a factor over the norm the other
  towers make of its batch, from the criterion's fetched `values`.

  The criterion (`core.tower_outliers`) names a tower whose excess (its
  log-ratio, above the others' 1x) strays above its usual one by more
  than `sigma` of its running standard deviations and by at least
  `min_factor`: the band is up to the usual ratio times exp(max(sigma *
  sd, log(min_factor))), its sd recovered from the step's distance in
  sigmas; from 0 (a gradient too small is no outlier).
  """
  usual = float(np.reshape(values["usual"], [-1])[position])
  observed = float(np.reshape(values["ratio"], [-1])[position])
  sigmas = float(np.reshape(values["sigmas"], [-1])[position])
  distance = max(math.log(observed), 0.0) - math.log(usual)
  sd = distance / sigmas if np.isfinite(sigmas) and sigmas > 0 else 0.0
  width = max(criterion.config.sigma * sd,
              math.log(criterion.config.min_factor))
  return 0.0, usual * math.exp(width)


def named(criterion, values, built):
  """(tower, `band`) of the tower `criterion` (`core.tower_outliers`)
  named in a step, the farthest from its usual ratio if it named several,
  or None if it named none (2 towers: it names none).

  Args:
    criterion: the step's `tower_outliers.TowerOutliers`.
    values: its fetched values of the step.
    built: the built towers' indices (the values' positions).
  """
  towers = criterion.outlier_towers(values)
  if not towers:
    return None
  sigmas = np.reshape(values["sigmas"], [-1])
  tower = max(towers, key=lambda t: sigmas[built.index(t)])
  return tower, band(criterion, values, built.index(tower))


def ratios(gauged):
  """Each batch's gradient norm over the norm the other batches make of it
  (the criterion's statistic: `tower_outliers.log_excess_np`), from
  `gauged` [(grad_norm, output_grad_norm, shared_grad_norm)] replayed on
  the same weights; inf where not finite."""
  norms, outputs, shared = (np.array(c, np.float64) for c in zip(*gauged))
  r = np.exp(tower_outliers.log_excess_np(norms, outputs, shared[0]))
  return [float(v) if np.isfinite(v) else float("inf") for v in r]


def beyond(value, low_high):
  """Whether ratio `value` is outside the band `low_high`."""
  low, high = low_high
  return not low <= value <= high


def judge(ratio, others, low_high, device):
  """The verdict of a replayed outlier: (verdict, reproduced, exclude,
  evidence).

  Args:
    ratio: the outlier's batch's `ratios` entry, replayed on another
      device.
    others: the other towers' batches' `ratios` entries, on the same
      weights.
    low_high: the step's band (`band`).
    device: the outlier tower's device (suspect if it does not reproduce).
  """
  if not beyond(ratio, low_high):
    return (replay_lib.NOT_REPRODUCIBLE % device, False, False,
            "within the band on replay")
  # The reference holds if the other batches agree among themselves, by
  # the band: the evidence rule's "another batch passes".
  if all(not beyond(o, low_high) for o in others):
    return (replay_lib.REPRODUCIBLE, True, True,
            "outside the band again on another device; the other towers' "
            "batches agree on these weights")
  return (UNDECIDED, True, False, "the other towers' batches disagree "
          "among themselves on these weights")


UNDECIDED = ("reproducible, but the other batches disagree too: the data "
             "or the model; not excluded")


def _words(norm, r, low_high):
  """"gradient norm 67.8, 17.3x what the other towers make of its batch
  (band up to 3.07x)"."""
  return ("gradient norm %.4g, %sx what the other towers make of its batch "
          "(band up to %.3gx)" % (norm, "%.3g" % r if np.isfinite(r)
                                  else "inf", low_high[1]))


def _feed(forensics, tower, batch, scale):
  """A replay's feeds of `batch` into `tower` (its drill's in-step faults
  off, the step's loss scale)."""
  feed = {tower.images: batch[0], tower.labels: batch[1]}
  feed.update(tower.fault_feeds)
  if forensics.loss_scale is not None and scale is not None:
    feed[forensics.loss_scale] = scale
  return feed


def _gauged(session, forensics, pairs, scale):
  """[(gradient norm, output gradient norm, shared gradient norm)] of
  (tower, batch) `pairs`, replayed in one run."""
  feed = {forensics.store.replaying: True}
  for tower, batch in pairs:
    feed.update(_feed(forensics, tower, batch, scale))
  return [tuple(float(v) for v in values) for values in session.run(
      [(tower.grad_norm,) + tuple(tower.gauge) for tower, _ in pairs],
      feed_dict=feed)]


def explain(session, forensics, tower_index, batches, low_high, scale=None,
            name=str):
  """Replays outlier tower `tower_index`; returns the record's parts.

  Args:
    session: a session of the step's graph.
    forensics: the graph's `replay_lib.Forensics`, its towers built with
      their `grad_norm`.
    tower_index: the tower the criterion named.
    batches: every tower's stored (images, labels, ids).
    low_high: the step's band for the tower (`band`).
    scale: the loss scale the step used (fp16), or None.
    name: example id -> its name (`data.describe_id`).

  Returns:
    A dict as `replay_lib.explain`'s ("replay", "other", "verdict",
    "reproduced", "exclude", "evidence", "suspect_device", "weaker",
    "seconds"); "replay" has the batch's `grad_norm` on tower `on_tower`'s
    device, the others' (`other_norms`, by tower) and their `ratios`
    (`other_ratios`), the
    `ratio` (None if infinite) and the `band`.

  Raises:
    ValueError: fewer than 2 other towers, or their norms not built.
  """
  towers = forensics.towers
  suspect = towers[tower_index]
  others = [t for t in towers[tower_index + 1:] + towers[:tower_index]
            if t is not None]
  if len(others) < 2 or any(t.grad_norm is None for t in others):
    raise ValueError("an outlier's replay needs 2 other towers with their "
                     "gradient norms built")
  started = time.time()
  reference = _gauged(session, forensics,
                      [(t, batches[t.index]) for t in others], scale)
  on = others[0]  # The next tower (replay_lib's "other" too).
  replayed = _gauged(session, forensics, [(on, batches[tower_index])],
                     scale)
  seconds = round(time.time() - started, 4)
  norm = replayed[0][0]
  r, *other_ratios = ratios(replayed + reference)
  verdict, reproduced, exclude, evidence = judge(r, other_ratios, low_high,
                                                 suspect.device)
  ids = [int(i) for i in batches[tower_index][2]]
  return {
      "replay": {"tower": tower_index, "device": suspect.device,
                 "on_tower": on.index, "on_device": on.device,
                 "finite": True, "input_rows": {}, "input_ids": [],
                 "grad_norm": norm,
                 "ratio": r if np.isfinite(r) else None,
                 "band": [float(b) for b in low_high],
                 "other_norms": {str(t.index): g[0]
                                 for t, g in zip(others, reference)},
                 "other_ratios": {str(t.index): o
                                  for t, o in zip(others, other_ratios)},
                 "seconds": seconds,
                 "text": "batch (examples %s) replayed on tower %d (%s): %s"
                         % (_examples(ids, name), on.index, on.device,
                            _words(norm, r, low_high))},
      "other": {"tower": on.index, "device": on.device, "finite": True,
                "grad_norm": norm, "seconds": seconds},
      "verdict": verdict, "reproduced": reproduced, "exclude": exclude,
      "evidence": evidence,
      "suspect_device": None if reproduced else suspect.device,
      "weaker": False, "seconds": seconds}


def _examples(ids, name, shown=8):
  """The batch's first `shown` examples by name, and "+N more"."""
  words = ", ".join(name(i) for i in ids[:shown])
  if len(ids) > shown:
    words += ", +%d more" % (len(ids) - shown)
  return "[%s]" % words
