"""Replaying a skipped step's batch: the first non-finite op, data or device.

At graph build each tower gets a `core.replay.Probe` over its forward and
backward graph (inputs: the images and labels its model read; outputs: its
loss and gradients); `Forensics` holds them with the batch store. After a
skip (the weights are exactly as the step saw them: nothing moved) `explain`
feeds the offending tower's stored batch to its own probe, and to another
tower's to tell data from device:
  * non-finite on both -> "reproducible (data or model)";
  * finite on either -> "not reproducible: suspect <the tower's device>".
With one tower the replay runs on the same device, so a device fault that
recurs looks like data: the record says the verdict is weaker.

A replay feeds the drill's in-step faults (loss, grads) inactive, and the
loss scale the step used (fp16), so only what the stored batch carries is
replayed: an input drill is data and stays in the batch.
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import replay

tf1 = tf.compat.v1

REPRODUCIBLE = "reproducible (data or model)"
NOT_REPRODUCIBLE = "not reproducible: suspect %s"
WEAKER = ("one tower: replayed on the same device, so a fault of that device "
          "that recurs would look like data")

TowerProbe = collections.namedtuple("TowerProbe", [
    "index", "device", "images", "labels", "loss", "probe", "fault_feeds"])
TowerProbe.__doc__ = """One tower's replay: its probe and what it is fed.

Attributes:
  index, device: the tower's index and device string.
  images, labels: the tensors its model read (a replay feeds them).
  loss: its loss tensor.
  probe: `core.replay.Probe` over its loss and gradients.
  fault_feeds: feeds that disable the drill's in-step faults of the tower.
"""


def tower_probe(index, device, images, labels, loss, grads_and_vars,
                tower_drill):
  """Builds tower `index`'s probe (call in the tower's device and scope)."""
  grads = []
  for g, _ in grads_and_vars:
    if isinstance(g, tf.IndexedSlices):
      g = g.values
    if g is not None:
      grads.append(g)
  faults = tower_drill.in_step_faults()
  # The drill's flags are inputs too: the walk stops there, so its NaN
  # constants (inactive on replay) are not taken for the first fault.
  probe = replay.Probe([images, labels] + list(faults), [loss] + grads)
  return TowerProbe(index, device, images, labels, loss, probe, faults)


class Forensics(object):
  """What a skip's explanation needs from the graph, built with the step.

  Attributes:
    store: the `batch_store.BatchStore` every step writes.
    towers: `TowerProbe` per tower.
    loss_scale: the loss scale tensor the step multiplied by (fp16) or None.
    saver: a `tf1.train.Saver` of the model's state (the skip's checkpoint).
  """

  def __init__(self, store, towers, loss_scale=None):
    self.store = store
    self.towers = list(towers)
    self.loss_scale = loss_scale
    # Built now: the session's graph is finalized before any skip.
    self.saver = tf1.train.Saver(tf1.global_variables(), max_to_keep=None,
                                 save_relative_paths=True)


def _replay(session, forensics, tower, batch, scale):
  images, labels = batch[0], batch[1]
  # `replaying`: the towers' input reads the store, never the iterator.
  feed = {forensics.store.replaying: True, tower.images: images,
          tower.labels: labels}
  feed.update(tower.fault_feeds)
  if forensics.loss_scale is not None and scale is not None:
    feed[forensics.loss_scale] = scale
  return tower.probe.run(session, feed)


def _rows(finding, tower, ids):
  """{input: rows} ("images", "labels"), and the example ids of the rows."""
  names = {tower.images.name: "images", tower.labels.name: "labels"}
  rows = {names.get(name, name): [int(r) for r in rs]
          for name, rs in (finding.nonfinite_inputs or {}).items()}
  bad = sorted(set(r for rs in rows.values() for r in rs))
  return rows, [int(ids[r]) for r in bad if r < len(ids)]


def explain(session, forensics, tower_index, batch, scale=None):
  """Replays tower `tower_index`'s `batch` and returns the record's parts.

  Args:
    session: a session of the step's graph (a hook's `run_context.session`).
    forensics: the graph's `Forensics`.
    tower_index: the tower whose step was non-finite.
    batch: its stored (images, labels, ids) NumPy arrays.
    scale: the loss scale the step used (fp16), or None.

  Returns:
    A dict: "replay" (tower, device, finite, first_op, phase, input_rows,
    input_ids, nonfinite_outputs, ops_checked, ops_not_checked, seconds,
    text), "other" (the same batch on another tower: tower, device, finite,
    first_op, seconds), "verdict" (text), "reproduced" (bool),
    "suspect_device" (or None), "weaker" (one tower), "seconds" (both
    replays).
  """
  towers = forensics.towers
  tower = towers[tower_index]
  ids = batch[2]
  finding = _replay(session, forensics, tower, batch, scale)
  input_rows, input_ids = _rows(finding, tower, ids)
  result = {
      "replay": {
          "tower": tower.index, "device": tower.device,
          "finite": bool(finding.finite), "first_op": finding.first_op,
          "phase": finding.phase, "input_rows": input_rows,
          "input_ids": input_ids,
          "nonfinite_outputs": list(finding.nonfinite_outputs or []),
          "ops_checked": finding.ops_checked,
          "ops_not_checked": finding.ops_not_checked,
          "seconds": round(finding.seconds, 4),
          "text": replay.describe(finding, example_ids=list(ids))},
      "weaker": len(towers) == 1,
  }
  seconds = finding.seconds
  reproduced = not finding.finite
  if reproduced and len(towers) > 1:
    other = towers[(tower_index + 1) % len(towers)]
    elsewhere = _replay(session, forensics, other, batch, scale)
    seconds += elsewhere.seconds
    result["other"] = {"tower": other.index, "device": other.device,
                       "finite": bool(elsewhere.finite),
                       "first_op": elsewhere.first_op,
                       "seconds": round(elsewhere.seconds, 4)}
    reproduced = not elsewhere.finite
  result["reproduced"] = reproduced
  result["suspect_device"] = None if reproduced else tower.device
  result["verdict"] = (REPRODUCIBLE if reproduced
                       else NOT_REPRODUCIBLE % tower.device)
  result["seconds"] = round(seconds, 4)
  return result


def line(step, explained):
  """The one log line of an explained skip."""
  text = "step %d tower %d: %s; %s" % (
      step, explained["replay"]["tower"], explained["replay"]["text"],
      explained["verdict"])
  if explained["weaker"] and explained["reproduced"]:
    text += " (%s)" % WEAKER
  return text
