"""Replaying a skipped step's batch: the first non-finite op, data or device.

At graph build each tower gets a `core.replay.Probe` over its forward and
backward graph (inputs: the images and labels its model read; outputs: its
loss and gradients); `Forensics` holds them with the batch store. After a
skip (the weights are exactly as the step saw them: nothing moved) `explain`
feeds the offending tower's stored batch to its own probe, and to another
tower's to tell data from device:
  * finite on either -> "not reproducible: suspect <the tower's device>";
  * non-finite on both, then data or model, on evidence only:
    - its input holds NaN/Inf -> the data ("reproducible: the data");
    - another batch passes on the same weights (another tower's in the
      step, else the last applied batch, replayed) -> the data;
    - every other batch tried fails too -> the model ("every batch fails
      on these weights: the model, not the data"): nothing is excluded;
    - no other batch to try (one tower, nothing applied yet in this
      process) -> undecided, nothing excluded.
With one tower the replay runs on the same device, so a device fault that
recurs looks like data: the record says the verdict is weaker.

A replay feeds the drill's in-step faults (loss, grads) inactive, and the
loss scale the step used (fp16), so only what the stored batch carries is
replayed: an input drill is data and stays in the batch.

The probes and the skip's saver are built only where a replay can happen
(`can_replay`): they roughly double a tower's graph, which a run that never
replays would build, serialise into graph.pbtxt and load into its session
for nothing. Its skips are still recorded (the store and the losses stay).
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import replay

tf1 = tf.compat.v1

# The verdicts of a replay, and what each rests on (docs/forensics.md):
# the data only on evidence of data, never because a batch fails on weights
# that fail on every batch.
REPRODUCIBLE = "reproducible: the data"
MODEL = "every batch fails on these weights: the model, not the data"
UNDECIDED = ("reproducible, but no other batch to compare on these weights: "
             "the data or the model; not excluded")
NOT_REPRODUCIBLE = "not reproducible: suspect %s"
WEAKER = ("one tower: replayed on the same device, so a fault of that device "
          "that recurs would look like data")


def can_replay(params):
  """Whether a run of `params` may replay a skip, so builds the probes.

  `forensics.ForensicsHook` replays up to --max_explained_skips skips, and
  past that limit a tower --quarantine_after counts (`quarantine`, which
  the runner makes whenever it is set) gets replays of its own.
  """
  return params.max_explained_skips > 0 or params.quarantine_after > 0


TowerProbe = collections.namedtuple("TowerProbe", [
    "index", "device", "images", "labels", "loss", "probe", "fault_feeds",
    "grad_norm", "gauge"], defaults=(None, None))
TowerProbe.__doc__ = """One tower's replay: its probe and what it is fed.

Attributes:
  index, device: the tower's index and device string.
  images, labels: the tensors its model read (a replay feeds them).
  loss: its loss tensor.
  probe: `core.replay.Probe` over its loss and gradients, or None in a
    step built without probes (`can_replay` false): the tower's loss and
    input are still recorded, but `explain` refuses to replay it.
  fault_feeds: feeds that disable the drill's in-step faults of the tower.
  grad_norm: its gradients' global norm (`core.norms`), fetched only by an
    outlier's replay (`outlier_replay`), or None (not built: no
    --skip_tower_outliers).
  gauge: with `grad_norm`, (its output gradient norm, the shared gradient
    norm): what its batch explains of the norm (`tower_loss`), or None.
"""


def tower_probe(index, device, images, labels, loss, grads_and_vars,
                tower_drill, build_probe=True, grad_norm=None, gauge=None):
  """Tower `index`'s `TowerProbe` (call in the tower's device and scope);
  its probe is built only if `build_probe`, else None (and `grad_norm`
  and `gauge`, what an outlier's replay fetches, dropped)."""
  # (A drill's flag that is a constant, e.g. the NaN flag of a tower with
  # only scale rules, cannot be fed: `poison` read its static value.)
  faults = {k: v for k, v in tower_drill.in_step_faults().items()
            if k.graph.is_feedable(k)}
  if not build_probe:
    return TowerProbe(index, device, images, labels, loss, None, faults)
  grads = []
  for g, _ in grads_and_vars:
    if isinstance(g, tf.IndexedSlices):
      g = g.values
    if g is not None:
      grads.append(g)
  # The drill's flags are inputs too: the walk stops there, so its NaN
  # constants (inactive on replay) are not taken for the first fault.
  probe = replay.Probe([images, labels] + list(faults), [loss] + grads)
  return TowerProbe(index, device, images, labels, loss, probe, faults,
                    grad_norm, gauge)


class Forensics(object):
  """What a skip's explanation needs from the graph, built with the step.

  Attributes:
    store: the `batch_store.BatchStore` every step writes.
    towers: `TowerProbe` per tower (None for a quarantined tower).
    loss_scale: the loss scale tensor the step multiplied by (fp16) or None.
    replays: whether the step was built to replay (`can_replay`): its
      towers have probes and `saver` exists; if not, every tower's `probe`
      and `saver` are None, and `explain` raises.
    saver: a `tf1.train.Saver` of the model's state (the skip's checkpoint,
      saved only with a replay), or None.
  """

  def __init__(self, store, towers, loss_scale=None, replays=True):
    self.store = store
    self.towers = list(towers)
    self.loss_scale = loss_scale
    self.replays = replays
    if replays and any(t is not None and t.probe is None
                       for t in self.towers):
      raise ValueError("Forensics: replays=True, but a tower has no probe")
    # Built now: the session's graph is finalized before any skip.
    self.saver = tf1.train.Saver(
        tf1.global_variables(), max_to_keep=None,
        save_relative_paths=True) if replays else None


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


def _evidence(session, forensics, tower_index, flags, scale, replay_on):
  """Whether another batch passes on the skip's weights: (verdict, exclude,
  evidence text, control dict or None) of a batch that failed on every
  tower it was replayed on, with a finite input."""
  others = [t for t in range(len(forensics.towers))
            if t != tower_index and forensics.towers[t] is not None]
  if flags is not None:
    passed = [t for t in others if t < len(flags) and not flags[t]]
    if passed:  # The same weights, the same step: another batch was fine.
      return (REPRODUCIBLE, True, "tower %d's batch of the step was finite "
              "on the same weights" % passed[0],
              {"source": "step", "tower": passed[0], "finite": True})
  applied = forensics.store.read_applied(session)
  if applied is not None:
    finding = replay_on(forensics.towers[tower_index], applied)
    control = {"source": "last_applied_batch", "step": applied[3],
               "finite": bool(finding.finite), "first_op": finding.first_op,
               "seconds": round(finding.seconds, 4)}
    if finding.finite:
      return (REPRODUCIBLE, True, "the last applied batch (step %d) is "
              "finite on these weights" % applied[3], control)
    return (MODEL, False, "the last applied batch (step %d) fails on these "
            "weights too" % applied[3], control)
  if flags is not None and others:
    return (MODEL, False, "every tower's batch of the step failed", None)
  return (UNDECIDED, False, "no other batch was tried on these weights",
          None)


def explain(session, forensics, tower_index, batch, scale=None, flags=None):
  """Replays tower `tower_index`'s `batch` and returns the record's parts.

  Args:
    session: a session of the step's graph (a hook's `run_context.session`).
    forensics: the graph's `Forensics`.
    tower_index: the tower whose step was non-finite.
    batch: its stored (images, labels, ids) NumPy arrays.
    scale: the loss scale the step used (fp16), or None.
    flags: each tower's non-finite flag in the step, or None (unknown).

  Returns:
    A dict: "replay" (tower, device, finite, first_op, phase, input_rows,
    input_ids, nonfinite_outputs, ops_checked, ops_not_checked, seconds,
    text), "other" (the same batch on another tower: tower, device, finite,
    first_op, seconds), "verdict" (text), "reproduced" (bool), "exclude"
    (bool: the evidence says the data), "evidence" (text), "control" (the
    other batch compared, if any), "suspect_device" (or None), "weaker"
    (one tower), "seconds" (every replay).

  Raises:
    ValueError: the step was built without probes (`Forensics.replays`).
  """
  if not forensics.replays:
    raise ValueError("this step was built without replay probes "
                     "(--max_explained_skips=0, no --quarantine_after): "
                     "no skip of it can be replayed")
  towers = forensics.towers
  tower = towers[tower_index]
  ids = batch[2]
  spent = []

  def replay_on(on_tower, on_batch):
    found = _replay(session, forensics, on_tower, on_batch, scale)
    spent.append(found.seconds)
    return found

  finding = replay_on(tower, batch)
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
      "weaker": sum(t is not None for t in towers) == 1,
  }
  reproduced = not finding.finite
  # (A quarantined tower has no probe: never built.)
  built = [t for t in towers[tower_index + 1:] + towers[:tower_index]
           if t is not None]
  if reproduced and built:
    other = built[0]
    elsewhere = replay_on(other, batch)
    result["other"] = {"tower": other.index, "device": other.device,
                       "finite": bool(elsewhere.finite),
                       "first_op": elsewhere.first_op,
                       "seconds": round(elsewhere.seconds, 4)}
    reproduced = not elsewhere.finite
  if not reproduced:
    verdict, exclude, evidence, control = (
        NOT_REPRODUCIBLE % tower.device, False, "finite on replay", None)
  elif input_ids:
    verdict, exclude, evidence, control = (
        REPRODUCIBLE, True, "its input holds NaN/Inf", None)
  else:
    verdict, exclude, evidence, control = _evidence(
        session, forensics, tower_index, flags, scale, replay_on)
  if control is not None:
    result["control"] = control
  result.update(reproduced=reproduced, exclude=exclude, evidence=evidence,
                verdict=verdict,
                suspect_device=None if reproduced else tower.device,
                seconds=round(sum(spent), 4))
  return result


def line(step, explained):
  """The one log line of an explained skip."""
  text = "step %d tower %d: %s; %s" % (
      step, explained["replay"]["tower"], explained["replay"]["text"],
      explained["verdict"])
  if explained["reproduced"] and explained.get("evidence"):
    text += " (%s)" % explained["evidence"]
  if explained["weaker"] and explained.get(
      "exclude", explained["reproduced"]):
    text += " (%s)" % WEAKER
  return text
