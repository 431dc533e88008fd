"""--skip_tower_outliers declared (`criterion_spec`): flags, checks, config.

No TensorFlow: `//:train` checks these flags before TensorFlow's import.
The criterion itself is `tower_outliers.TowerOutliers`.
"""

import collections
import math

from tf1_safe_train.core import checks
from tf1_safe_train.core import criterion_spec

REASON = "tower_outlier"
FLAG = "skip_tower_outliers"
_require = criterion_spec.require


class TowerOutlierConfig(collections.namedtuple(
    "TowerOutlierConfig", "sigma min_factor warmup_steps decay dry_run")):
  """What a step calls an outlier tower.

  Attributes:
    sigma: K: a tower whose gradient norm's log-ratio to what the other
      towers make of its batch (`tower_outliers`), above 1x, exceeds its
      own running mean by more than K of its running standard deviations
      is an outlier (> 0).
    min_factor: and only if it exceeds it by at least this factor (> 1):
      a tower's ratio moving from 1.0x to 1.5x is never an outlier,
      however steady its history.
    warmup_steps: applied steps of history before any tower is an outlier.
    decay: the statistics' moving-average decay once warm (the first
      1 / (1 - decay) values are averaged evenly).
    dry_run: report and count what would be left out or skipped
      (`tower_outlier_would_skips`), change nothing.
  """
  __slots__ = ()

  def __new__(cls, sigma, min_factor=3.0, warmup_steps=100, decay=0.99,
              dry_run=False):
    return super(TowerOutlierConfig, cls).__new__(
        cls, sigma, min_factor, warmup_steps, decay, dry_run)

  @classmethod
  def of(cls, value):
    """`value` (a `TowerOutlierConfig` or a number, the sigma), validated."""
    config = value if isinstance(value, TowerOutlierConfig) else cls(value)
    return config.validate()

  def validate(self):
    """Returns self; raises ValueError naming the first bad field."""
    _require(checks.is_number(self.sigma) and math.isfinite(self.sigma) and
             self.sigma > 0,
             "skip_tower_outliers: sigma=%r must be a finite number > 0",
             self.sigma)
    _require(checks.is_number(self.min_factor) and
             math.isfinite(self.min_factor) and self.min_factor > 1,
             "skip_tower_outliers: min_factor=%r must be a finite number > 1",
             self.min_factor)
    _require(checks.is_int(self.warmup_steps) and self.warmup_steps >= 1,
             "skip_tower_outliers: warmup_steps=%r must be an integer >= 1",
             self.warmup_steps)
    _require(checks.is_number(self.decay) and 0 < self.decay < 1,
             "skip_tower_outliers: decay=%r must be in (0, 1)", self.decay)
    _require(isinstance(self.dry_run, bool),
             "skip_tower_outliers: dry_run=%r must be a boolean",
             self.dry_run)
    return self


def check_params(params):
  """The flags' checks (with the run's other flags they depend on)."""
  criterion_spec.require_finite_at_least_zero(FLAG, params.skip_tower_outliers)
  factor = params.skip_tower_outliers_min_factor
  _require(checks.is_number(factor) and math.isfinite(factor) and factor > 1,
           "--skip_tower_outliers_min_factor=%r: must be a finite number > 1",
           factor)
  warmup = params.skip_tower_outliers_warmup_steps
  _require(checks.is_int(warmup) and warmup >= 1,
           "--skip_tower_outliers_warmup_steps=%r: must be an integer >= 1",
           warmup)
  _require(isinstance(params.skip_tower_outliers_dry_run, bool),
           "--skip_tower_outliers_dry_run=%r: must be a boolean",
           params.skip_tower_outliers_dry_run)
  _require(not params.skip_tower_outliers_dry_run or
           params.skip_tower_outliers > 0,
           "--skip_tower_outliers_dry_run needs --skip_tower_outliers > 0")
  # The chief decides on the aggregate gradients; no tower reaches it.
  _require(not (params.skip_tower_outliers and
                getattr(params, "sync_replicas", False)),
           "--skip_tower_outliers is not supported with --sync_replicas (the "
           "chief decides on the aggregate gradients and sees no tower)")
  # Towers are compared with each other: one tower has no other.
  _require(not params.skip_tower_outliers or
           getattr(params, "num_towers", 2) >= 2,
           "--skip_tower_outliers needs --num_towers >= 2 (a tower is "
           "compared with the others)")


def config_of_params(params):
  """The run's `TowerOutlierConfig`, or None without --skip_tower_outliers."""
  if not params.skip_tower_outliers:
    return None
  return TowerOutlierConfig(
      params.skip_tower_outliers, params.skip_tower_outliers_min_factor,
      params.skip_tower_outliers_warmup_steps,
      dry_run=params.skip_tower_outliers_dry_run)


_Flag = criterion_spec.Flag
SPEC = criterion_spec.CriterionSpec(
    reason=REASON,
    flags=(
        _Flag(FLAG, 0.0,
              "A tower whose gradient norm is too large for its batch (its "
              "ratio to the other towers' norm per unit of output gradient, "
              "times its own; log scale) beyond its own running history by "
              "more than this many standard deviations is an outlier: left "
              "out with --skip_unit=tower, else the step is skipped (2 "
              "towers: either too large, the step skipped); e.g. 6; 0 = "
              "off."),
        _Flag("skip_tower_outliers_min_factor", 3.0,
              "--skip_tower_outliers: and only if its ratio exceeds its "
              "history by at least this factor (> 1)."),
        _Flag("skip_tower_outliers_warmup_steps", 100,
              "--skip_tower_outliers: applied steps of history before a "
              "tower can be an outlier."),
        _Flag("skip_tower_outliers_dry_run", False,
              "--skip_tower_outliers: leave out and skip nothing, only "
              "report each outlier (log line, skips.jsonl record with "
              "dry_run, tower_outlier_would_skips): to calibrate K."),
    ),
    group="Towers that disagree with the others",
    check=check_params,
    config=config_of_params,
    criterion="tf1_safe_train.core.tower_outliers:TowerOutliers",
    keyword=FLAG,
    keyword_config=TowerOutlierConfig.of)
