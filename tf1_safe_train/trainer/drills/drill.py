"""The fault drill of one run: `--inject_nonfinite` parsed once, per tower.

A `Drill` holds the run's validated `injection.Rule`s and where they poison
(`--inject_into`: the input, the loss or the gradients); `Drill.tower` gives
one tower its three poison points, each the identity (no op added) unless
that point is the target and a rule names that tower and worker. A scaleF
rule multiplies the target by F instead (a finite spike: every gradient of
the tower, its loss, or its input).
"""

import tensorflow as tf

from tf1_safe_train.core import gradients
from tf1_safe_train.trainer.drills import injection

TARGETS = ("input", "loss", "grads")


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
    injection.validate(rules, num_towers, num_workers)
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
    if not any(r.tower == tower and r.worker == worker for r in self.rules):
      return TowerDrill(None, None, None)
    active, value = injection.active_value(self.rules, step, tower=tower,
                                           worker=worker, seed=self.seed)
    factor = None
    if any(injection.is_scale(r) and r.tower == tower and r.worker == worker
           for r in self.rules):
      scaled, by = injection.active_value(self.rules, step, tower=tower,
                                          worker=worker, seed=self.seed,
                                          scale=True)
      factor = tf.where(scaled, by, tf.constant(1.0))
    return TowerDrill(self.target, active, value, factor)


class TowerDrill(object):
  """One tower's poison points; each returns its argument unless targeted."""

  def __init__(self, target, active, value, factor=None):
    self._target = target
    self._active = active
    self._value = value
    self._factor = factor  # float32 scalar (1.0 when inactive), or None.
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
    return feeds

  def loss(self, loss):
    if self._target != "loss":
      return loss
    loss = self._scaled(loss)
    # Multiplicative, so the fault reaches the gradients as a real NaN/Inf
    # loss does (a replaced value would carry a zero gradient).
    return loss * tf.where(self._active, self._value, tf.constant(1.0))

  def grads(self, grads_and_vars):
    """Scales every gradient; poisons the first (of the first variable that
    has one)."""
    if self._target != "grads":
      return list(grads_and_vars)
    # A scale spikes the whole tower's gradients, as a bad device would.
    grads_and_vars = gradients.map_gradients(self._scaled, grads_and_vars)
    for i, (g, v) in enumerate(grads_and_vars):
      if g is not None:
        grads_and_vars[i] = (injection.poison(g, self._active, self._value), v)
        break
    return grads_and_vars
