"""The spike criterion declared (`criterion_spec`): flags, checks, config.

No TensorFlow: `//:train` checks these flags before TensorFlow's import.
The detector itself is `spikes.SpikeDetector`.
"""

import collections
import math

from tf1_safe_train.core import checks
from tf1_safe_train.core import criterion_spec

REASON = "spike"
_require = criterion_spec.require


class SpikeConfig(collections.namedtuple(
    "SpikeConfig", "sigma warmup_steps max_streak loss decay dry_run")):
  """What a step calls a spike.

  Attributes:
    sigma: K: a value above mean + K standard deviations of its log is a
      spike (> 0).
    warmup_steps: applied steps of history before anything is a spike.
    max_streak: this many spike skips in a row re-warm the detector.
    loss: also watch the loss (needs the step's loss; its log is taken, so
      a loss <= 0 is never a spike and never enters the statistics).
    decay: the statistics' moving-average decay once warm (the first
      1 / (1 - decay) values are averaged evenly).
    dry_run: report and count what would be skipped (`spike_would_skips`),
      skip nothing: how a threshold is calibrated before it is trusted.
  """
  __slots__ = ()

  def __new__(cls, sigma, warmup_steps=100, max_streak=10, loss=False,
              decay=0.99, dry_run=False):
    return super(SpikeConfig, cls).__new__(cls, sigma, warmup_steps,
                                           max_streak, loss, decay, dry_run)

  @classmethod
  def of(cls, value):
    """`value` (a `SpikeConfig` or a number, the sigma), validated."""
    config = value if isinstance(value, SpikeConfig) else cls(value)
    return config.validate()

  def validate(self):
    """Returns self; raises ValueError naming the first bad field."""
    _require(checks.is_number(self.sigma) and math.isfinite(self.sigma) and
             self.sigma > 0,
             "skip_spikes: sigma=%r must be a finite number > 0", self.sigma)
    for name in ("warmup_steps", "max_streak"):
      value = getattr(self, name)
      _require(checks.is_int(value) and value >= 1,
               "skip_spikes: %s=%r must be an integer >= 1", name, value)
    for name in ("loss", "dry_run"):
      _require(isinstance(getattr(self, name), bool),
               "skip_spikes: %s=%r must be a boolean", name,
               getattr(self, name))
    _require(checks.is_number(self.decay) and 0 < self.decay < 1,
             "skip_spikes: decay=%r must be in (0, 1)", self.decay)
    return self


def check_params(params):
  """The flags' checks (with the run's other flags they depend on)."""
  _require(checks.is_number(params.skip_spikes_sigma) and
           params.skip_spikes_sigma >= 0,
           "--skip_spikes_sigma=%r: must be >= 0 (0 = off)",
           params.skip_spikes_sigma)
  for name in ("spike_warmup_steps", "spike_max_streak"):
    value = getattr(params, name)
    _require(checks.is_int(value) and value >= 1,
             "--%s=%r: must be an integer >= 1", name, value)
  for name in ("skip_loss_spikes", "spike_dry_run"):
    _require(isinstance(getattr(params, name), bool),
             "--%s=%r: must be a boolean", name, getattr(params, name))
  _require(not params.spike_dry_run or params.skip_spikes_sigma > 0,
           "--spike_dry_run needs --skip_spikes_sigma > 0")
  _require(not (params.skip_spikes_sigma and params.max_consecutive_skips) or
           params.spike_max_streak < params.max_consecutive_skips,
           "--spike_max_streak=%r: must be below --max_consecutive_skips=%r "
           "(the run would give up before the spike detector re-warms)",
           params.spike_max_streak, params.max_consecutive_skips)
  _require(not params.skip_loss_spikes or params.skip_spikes_sigma > 0,
           "--skip_loss_spikes needs --skip_spikes_sigma > 0")
  # The chief decides on the aggregate gradients; no loss reaches it.
  _require(not (params.skip_loss_spikes and params.sync_replicas),
           "--skip_loss_spikes is not supported with --sync_replicas (the "
           "chief decides on the aggregate gradients and sees no loss)")


def config_of_params(params):
  """The run's `SpikeConfig`, or None without --skip_spikes_sigma."""
  if not params.skip_spikes_sigma:
    return None
  return SpikeConfig(params.skip_spikes_sigma, params.spike_warmup_steps,
                     params.spike_max_streak, params.skip_loss_spikes,
                     dry_run=params.spike_dry_run)


_Flag = criterion_spec.Flag
SPEC = criterion_spec.CriterionSpec(
    reason=REASON,
    flags=(
        _Flag("skip_spikes_sigma", 0.0,
              "Also skip a finite step whose global gradient norm exceeds "
              "its running mean over applied steps by more than this many "
              "standard deviations (log scale), e.g. 6; 0 = off."),
        _Flag("spike_warmup_steps", 100,
              "--skip_spikes_sigma: applied steps of history before a step "
              "can be a spike."),
        _Flag("spike_max_streak", 10,
              "--skip_spikes_sigma: this many spike skips in a row are a "
              "regime change, not a spike: the detector re-warms."),
        _Flag("skip_loss_spikes", False,
              "--skip_spikes_sigma: also skip a step whose loss is a spike "
              "(not with --sync_replicas: the chief sees no loss)."),
        _Flag("spike_dry_run", False,
              "--skip_spikes_sigma: skip no spike, only report each one it "
              "would skip (log line, skips.jsonl record with dry_run, "
              "spike_would_skips): to calibrate the threshold."),
    ),
    group="Finite spikes skipped too",
    check=check_params,
    config=config_of_params,
    criterion="tf1_safe_train.core.spikes:SpikeDetector",
    keyword="skip_spikes",
    keyword_config=SpikeConfig.of)
