"""The fault drill of one run: `--inject_nonfinite` parsed once, per tower.

A `Drill` holds the run's validated `injection.Rule`s and where they poison
(`--inject_into`: the input, the loss or the gradients); `Drill.tower` gives
one tower its three poison points, each the identity (no op added) unless
that point is the target and a rule names that tower and worker. A scaleF
rule multiplies the target by F instead (a finite spike: every gradient of
the tower, its loss, or its input); bitflipK and stale fault gradients
only: bit K of the largest-magnitude element of the tower's first gradient
flipped, or every gradient of the tower replaced by its value of the
previous step (`injection.flip_bit`, `injection.stale`).

A drill with a finite fault on gradients also lists, in the graph
collections `CLEAN_GRADIENTS` and `FAULTED_GRADIENTS`, every tower's
gradients without and with it (tower by tower, in variable order; no op
added), so that a bench can measure how far a fault moves the averaged
update (`//bench:sdc`).
"""

import tensorflow as tf

from tf1_safe_train.core import gradients
from tf1_safe_train.trainer.drills import injection

tf1 = tf.compat.v1

TARGETS = ("input", "loss", "grads")
CLEAN_GRADIENTS = "tf1_safe_train_drill_clean_gradients"
FAULTED_GRADIENTS = "tf1_safe_train_drill_faulted_gradients"
_FINITE = ("scale", "bitflip", "stale")


class Drill(object):
  """The validated drill of a run (immutable)."""

  __slots__ = ("rules", "target", "seed")

  def __init__(self, spec, target="grads", num_towers=1, num_workers=1,
               seed=0):
    """Parses and validates `spec` (see `injection`).

    Args:
      spec: the `--inject_nonfinite` spec ('' or None: no drill).
      target: 'input', 'loss' or 'grads' (`--inject_into`).
      num_towers: towers per worker.
      num_workers: workers of the run.
      seed: seed of the probability rules.

    Raises:
      injection.InjectionSpecError: for a bad spec or an index out of range.
      ValueError: for an unknown target.
    """
    if target not in TARGETS:
      raise ValueError("inject_into must be one of %s, got %r" %
                       (", ".join(TARGETS), target))
    rules = injection.parse_spec(spec)
    injection.validate(rules, num_towers, num_workers, target)
    for name, value in (("rules", rules), ("target", target), ("seed", seed)):
      object.__setattr__(self, name, value)

  def __setattr__(self, name, value):
    raise AttributeError("Drill is immutable; cannot set %r" % name)

  @classmethod
  def of(cls, params, num_towers, num_workers=1):
    """The drill `params` asks for (`inject_nonfinite`, `inject_into`)."""
    return cls(params.inject_nonfinite, params.inject_into, num_towers,
               num_workers, params.seed)

  def tower(self, step, tower, worker=0):
    """The poison points of one tower at `step` (an int64 tensor)."""
    record = self.target == "grads" and any(
        injection.group(r) in _FINITE for r in self.rules)
    groups = set(injection.group(r) for r in self.rules
                 if r.tower == tower and r.worker == worker)
    if not groups:
      return TowerDrill(None, None, None, record=record)
    actives = {}
    for name in sorted(groups | {"value"}):
      actives[name] = injection.active_value(
          self.rules, step, tower=tower, worker=worker, seed=self.seed,
          kind_group=name)
    active, value = actives.pop("value")
    factor = None
    if "scale" in actives:
      scaled, by = actives.pop("scale")
      factor = tf.where(scaled, by, tf.constant(1.0))
    return TowerDrill(self.target, active, value, factor, record=record,
                      finite=actives)


class TowerDrill(object):
  """One tower's poison points; each returns its argument unless targeted."""

  def __init__(self, target, active, value, factor=None, record=False,
               finite=None):
    """`finite`: {'bitflip' or 'stale': (active, value)} of its rules."""
    self._target = target
    self._active = active
    self._value = value
    self._factor = factor  # float32 scalar (1.0 when inactive), or None.
    self._record = record
    self._finite = dict(finite or {})
    self._value_row = self._factor_row = None
    if target in ("loss", "grads"):
      # A replay feeds the value inactive as a row: probes check inputs by
      # row (see `in_step_faults`).
      self._value_row = tf.reshape(value, [1], name="fault_value")
      self._value = self._value_row[0]
      if factor is not None:
        self._factor_row = tf.reshape(factor, [1], name="fault_factor")
        self._factor = self._factor_row[0]

  def _scaled(self, x):
    if self._factor is None:
      return x
    return gradients.map_values(lambda t: t * tf.cast(self._factor, t.dtype),
                                x)

  def input(self, images):
    if self._target != "input":
      return images
    return injection.poison(self._scaled(images), self._active, self._value)

  def in_step_faults(self):
    """Feeds that turn off this tower's in-step faults for a replay.

    The loss and gradient drills model a fault inside the step (a flaky
    device): a replay feeds them inactive. The input drill models data: the
    stored batch holds its poison, and the replay feeds that batch.
    """
    if self._value_row is None:
      return {}
    feeds = {self._active: False, self._value_row: [0.0]}
    if self._factor_row is not None:  # A scale drill: a device's spike.
      feeds[self._factor_row] = [1.0]
    for active, _ in self._finite.values():  # Bit flips, stale: a device's.
      feeds[active] = False
    # A kind without a rule on this tower is a constant False: no feed.
    return {t: v for t, v in feeds.items() if t.graph.is_feedable(t)}

  def loss(self, loss):
    if self._target != "loss":
      return loss
    loss = self._scaled(loss)
    # Multiplicative, so the fault reaches the gradients as a real NaN/Inf
    # loss does (a replaced value would carry a zero gradient).
    return loss * tf.where(self._active, self._value, tf.constant(1.0))

  def grads(self, grads_and_vars):
    """Makes every gradient stale, scales it; flips a bit of and poisons
    the first (of the first variable that has one)."""
    clean = list(grads_and_vars)
    if self._target != "grads":
      self._list(clean, clean)
      return clean
    grads_and_vars = clean
    if "stale" in self._finite:  # The whole tower lags, as a stale buffer.
      active = self._finite["stale"][0]
      grads_and_vars = gradients.map_gradients(
          lambda t: injection.stale(t, active), grads_and_vars)
    # A scale spikes the whole tower's gradients, as a bad device would.
    grads_and_vars = gradients.map_gradients(self._scaled, grads_and_vars)
    for i, (g, v) in enumerate(grads_and_vars):
      if g is not None:
        if "bitflip" in self._finite:
          active, bit = self._finite["bitflip"]
          g = gradients.map_values(
              lambda t: injection.flip_bit(t, bit, active), g)
        grads_and_vars[i] = (injection.poison(g, self._active, self._value), v)
        break
    self._list(clean, grads_and_vars)
    return grads_and_vars

  def _list(self, clean, faulted):
    """Adds the dense gradients to the bench's collections (`record`)."""
    if not self._record:
      return
    for (c, _), (f, _) in zip(clean, faulted):
      if isinstance(c, tf.Tensor) and isinstance(f, tf.Tensor):
        tf1.add_to_collection(CLEAN_GRADIENTS, c)
        tf1.add_to_collection(FAULTED_GRADIENTS, f)
