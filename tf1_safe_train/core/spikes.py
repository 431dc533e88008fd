"""Spike skips: a finite step far above its recent history is skipped too.

A `SpikeDetector` keeps running statistics of log(global gradient norm) (and,
if asked, of log(loss)) over applied steps; after a warm-up, a step whose
value exceeds the running mean by more than `sigma` standard deviations is
skipped by the same `tf.cond` as a non-finite step (`guard.guarded_apply`),
so nothing of the model moves on it either.

The detector is a skip criterion (`criteria.Criterion`, reason "spike").
The statistics are graph variables (checkpointed), written only in the apply
branch and only from finite values, so neither a spike nor a NaN step ever
touches them. A streak of `max_streak` spike skips is a regime change, not a
spike: the detector then re-warms (forgets its history) instead of skipping
for ever. In a dry run (`SpikeConfig(dry_run=True)`) it skips nothing: a
would-be spike is reported and counted, and folded into the statistics as
the applied step it is.
"""

import collections
import math

import tensorflow as tf

from tf1_safe_train.core import criteria
from tf1_safe_train.core import spikes_spec

tf1 = tf.compat.v1

REASON = spikes_spec.REASON
# Declared (flags, checks) without TensorFlow in `spikes_spec`.
SpikeConfig = spikes_spec.SpikeConfig
# Variables a checkpoint written without the option lacks: a resume
# initialises them afresh (the warm-up restarts) instead of failing.
OPTIONAL_STATE = criteria.OPTIONAL_STATE
# The reasons' counters (spike_skips among them), once per graph.
SPIKE_SKIPS_COLLECTION = criteria.COUNTERS_COLLECTION

ReasonCounters = collections.namedtuple("ReasonCounters",
                                        ["nonfinite_skips", "spike_skips"])
ReasonCounters.__doc__ = """Skipped steps by reason (int64 tensors).

Their sum is `skipped_steps` (each a counter of its own, incremented by
the skip branch: `reasons.Decision`).
"""

SpikeReport = collections.namedtuple("SpikeReport", [
    "spike", "rewarm", "grad_norm", "grad_threshold", "loss",
    "loss_threshold", "reasons", "rewarms"])
SpikeReport.__doc__ = """One step's spike decision, for reports and summaries.

Attributes:
  spike: bool scalar, True if the step is a spike (it is then skipped; a
    non-finite step is never called a spike).
  rewarm: bool scalar, True if this spike ended a streak of `max_streak`:
    the detector re-warms.
  grad_norm, grad_threshold: float32 scalars, the step's global gradient
    norm and the largest norm not called a spike (+inf during warm-up).
  loss, loss_threshold: the same for the loss, or None when not watched.
  reasons: `ReasonCounters` read after the step.
  rewarms: int64 scalar, re-warms so far, read after the step.
"""


_state_variable = criteria.state_variable


def spike_skips_variable(graph=None):
  """The graph's int64 `spike_skips` variable, created on first use."""
  return criteria.reason_counter(REASON, graph=graph)


def read_reasons(unused_skipped_steps, op):
  """`ReasonCounters` (the two reasons' counters) read after `op`."""
  with tf1.name_scope("read_spike_reasons"), tf1.control_dependencies([op]):
    return ReasonCounters(*[
        tf.identity(criteria.reason_counter(r).read_value())
        for r in (criteria.NONFINITE, REASON)])


class _LogStats(object):
  """Running mean and variance of a log value (two float32 variables)."""

  def __init__(self, name):
    self.mean = _state_variable(name + "_log_mean", tf.constant(0.0))
    self.var = _state_variable(name + "_log_var", tf.constant(0.0))

  def threshold(self, sigma, warm):
    """The largest log value that is no spike (+inf until `warm`)."""
    limit = self.mean.read_value() + sigma * tf.sqrt(self.var.read_value())
    return tf.where(warm, limit, tf.constant(math.inf))

  def update(self, x, rate):
    """Ops folding `x` in with weight `rate`; a non-finite `x` is ignored."""
    mean, var = self.mean.read_value(), self.var.read_value()
    delta = x - mean
    finite = tf.math.is_finite(x)
    # Exponentially weighted variance (West, 1979); rate 1 restarts at x.
    new_mean = tf.where(finite, mean + rate * delta, mean)
    new_var = tf.where(finite, (1.0 - rate) * (var + rate * delta * delta),
                       var)
    return [tf1.assign(self.mean, new_mean), tf1.assign(self.var, new_var)]


class SpikeDetector(criteria.Criterion):
  """The spike criterion of a step's decision (reason "spike").

  `decide` builds the spike flag before the `tf.cond`; `on_apply` and
  `on_skip` build the statistics' and streak's updates inside its branches.
  """

  reason = REASON

  def __init__(self, config):
    """Creates the state variables (under `init_scope`, at the root name
    scope, on the current device: a parameter server under a
    `replica_device_setter`)."""
    self.config = SpikeConfig.of(config)
    self.dry_run = self.config.dry_run
    with tf1.init_scope(), tf1.get_default_graph().name_scope(None):
      with tf1.name_scope("spike_stats"):
        self._count = _state_variable("applied", tf.constant(0, tf.int64))
        self._streak = _state_variable("streak", tf.constant(0, tf.int64))
        self._rewarms = _state_variable("rewarms", tf.constant(0, tf.int64))
        self._grad = _LogStats("grad_norm")
        self._loss = _LogStats("loss") if self.config.loss else None

  @property
  def variables(self):
    stats = [self._grad] + ([self._loss] if self._loss else [])
    return ([self._count, self._streak, self._rewarms] +
            [v for s in stats for v in (s.mean, s.var)])

  def decide(self, context):
    """Builds the step's spike flag and values (before the decision).

    The norm is the context's (`Context.global_norm`: over the trainable
    variables' gradients, not statistics deltas, without overflow); a
    non-finite step is skipped for that reason, never called a spike.

    Raises:
      ValueError: if the loss is watched and the context has none.
    """
    config = self.config
    if config.loss and not context.has_loss:
      raise ValueError("skip_spikes with loss=True needs the step's loss "
                       "(none was given to compute_gradients or "
                       "apply_gradients(loss=))")
    norm = context.global_norm
    with tf1.name_scope("spikes"):
      # An overflow to +inf is a spike too (its log exceeds any threshold
      # once warm).
      self._x = {"grad": tf.math.log(norm)}
      warm = self._count.read_value() >= config.warmup_steps
      limit = self._grad.threshold(config.sigma, warm)
      spike = self._x["grad"] > limit
      values = {"grad_norm": norm, "grad_threshold": tf.exp(limit)}
      if self._loss is not None:
        loss = tf.cast(context.loss, tf.float32)
        self._x["loss"] = tf.math.log(loss)
        loss_limit = self._loss.threshold(config.sigma, warm)
        spike = tf.logical_or(spike, self._x["loss"] > loss_limit)
        values.update(loss=loss, loss_threshold=tf.exp(loss_limit))
      spike = tf.logical_and(spike, tf.logical_not(context.nonfinite),
                             name="spike")
      self._spike = spike
      # (A dry run applies its spikes: no streak, no re-warm.)
      self._rewarm = tf.logical_and(
          spike, self._streak.read_value() + 1 >= config.max_streak,
          name="rewarm") if not self.dry_run else tf.constant(False)
    values["rewarm"] = self._rewarm
    self._values = values  # For `report` (`GuardResult.spikes`).
    return spike, values

  def on_apply(self, context):
    """Op for the apply branch: fold the step's finite values in."""
    count = self._count.read_value() + 1
    rate = tf.maximum(1.0 / tf.cast(count, tf.float32),
                      1.0 - self.config.decay)
    ops = self._grad.update(self._x["grad"], rate)
    if self._loss is not None:
      ops += self._loss.update(self._x["loss"], rate)
    ops += [tf1.assign(self._count, count),
            tf1.assign(self._streak, tf.constant(0, tf.int64))]
    return tf.group(*ops, name="spikes_on_apply")

  def on_skip(self, context):
    """Op for the skip branch: the streak; re-warm after a long one."""
    spike = tf.cast(self._spike, tf.int64)
    rewarm = self._rewarm
    streak = self._streak.read_value() + spike
    zero = tf.constant(0, tf.int64)
    return tf.group(
        tf1.assign(self._streak, tf.where(rewarm, zero, streak)),
        # Forgetting the count restarts the statistics at the next value.
        tf1.assign(self._count, tf.where(rewarm, zero,
                                         self._count.read_value())),
        tf1.assign_add(self._rewarms, tf.cast(rewarm, tf.int64)),
        name="spikes_on_skip")

  def describe(self, values):
    """"gradient norm N > threshold T[, loss ...][; ... re-warms]"."""
    parts = []
    if values["grad_norm"] > values["grad_threshold"]:
      parts.append("gradient norm %.4g > threshold %.4g" %
                   (values["grad_norm"], values["grad_threshold"]))
    if values.get("loss") is not None and (
        values["loss"] > values["loss_threshold"]):
      parts.append("loss %.4g > threshold %.4g" %
                   (values["loss"], values["loss_threshold"]))
    line = ", ".join(parts) or "-"
    if values["rewarm"]:
      line += ("; a streak of spike skips is a regime change: the spike "
               "detector re-warms")
    return line

  def record(self, values):
    return {k: (bool(v) if k == "rewarm" else float(v))
            for k, v in values.items()}

  def report(self, op):
    """Deprecated: the step's `SpikeReport` (`GuardResult.spikes`), read
    after `op`; `reasons.Report` says the same of every criterion."""
    reasons = read_reasons(None, op)
    with tf1.name_scope("read_spikes"), tf1.control_dependencies([op]):
      rewarms = tf.identity(self._rewarms.read_value())
    return SpikeReport(
        spike=self._spike, rewarm=self._rewarm,
        grad_norm=self._values["grad_norm"],
        grad_threshold=self._values["grad_threshold"],
        loss=self._values.get("loss"),
        loss_threshold=self._values.get("loss_threshold"),
        reasons=reasons, rewarms=rewarms)
