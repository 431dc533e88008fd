"""--skip_grad_norm_above declared (`criterion_spec`); no TensorFlow.

The criterion itself is `grad_norm.GradNormAbove`.
"""

from tf1_safe_train.core import criterion_spec

FLAG = "skip_grad_norm_above"


def check_params(params):
  criterion_spec.require_finite_at_least_zero(FLAG, getattr(params, FLAG))


def config_of_params(params):
  """The threshold, or None when off (0)."""
  return getattr(params, FLAG) or None


def _config_of_keyword(value):
  check_params(type("Keyword", (), {FLAG: value}))
  criterion_spec.require(value > 0, "%s=%r: must be > 0", FLAG, value)
  return float(value)


SPEC = criterion_spec.CriterionSpec(
    reason="grad_norm",
    flags=(criterion_spec.Flag(
        FLAG, 0.0, "Also skip a finite step whose global gradient norm "
        "exceeds this (a fixed ceiling; --skip_spikes_sigma adapts to the "
        "run); 0 = off."),),
    group="A gradient norm ceiling",
    check=check_params,
    config=config_of_params,
    criterion="tf1_safe_train.core.grad_norm:GradNormAbove",
    keyword_config=_config_of_keyword)
