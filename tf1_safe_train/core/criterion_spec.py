"""A skip criterion declared once: its flags, checks, and how it is built.

A `CriterionSpec` is what the rest of the package knows of a library
criterion (`criterion_registry` lists them): the trainer's params and
`//:train`'s flags, --help group and docs table come from its `flags`; the
early checks (before TensorFlow's import) run its `check`; the trainer and
the wrapper (`SkipNonFiniteOptimizer(opt, <keyword>=...)`) build it through
`config` and `criterion`. Its counters (`<reason>_skips`,
`<reason>_would_skips`) and report words (`Criterion.describe`, `record`)
follow from its reason and its class. This module imports no TensorFlow,
and neither may a spec's module.
"""

import dataclasses
import importlib
import math

from tf1_safe_train.core import checks

# The reason of the non-finite criterion, always first.
NONFINITE = "nonfinite"
# A reason counter's name after its reason (`counter_name`).
_SKIPS = "_skips"
_WOULD_SKIPS = "_would_skips"


def counter_name(reason, dry_run=False):
  """The name of `reason`'s counter: "<reason>_skips" (skips labelled with
  it), or for a dry run "<reason>_would_skips" (its would-be skips); the
  reports' (TensorBoard's `skips/<name>`, run_summary.json's) and the
  checkpoints'. Every reason's counter is named here, none by hand."""
  return reason + (_WOULD_SKIPS if dry_run else _SKIPS)


def counter_reason(name):
  """(reason, dry_run) of a counter named by `counter_name`."""
  if name.endswith(_WOULD_SKIPS):
    return name[:-len(_WOULD_SKIPS)], True
  if name.endswith(_SKIPS):
    return name[:-len(_SKIPS)], False
  raise ValueError("%r is no reason's counter" % (name,))



class SpecError(ValueError):
  """A criterion's parameter has a bad value; the message names it."""


def require(condition, message, *args):
  """Raises `SpecError(message % args)` unless `condition`."""
  if not condition:
    raise SpecError(message % args)


def require_finite_at_least_zero(name, value, off="0 = off"):
  """The common check of a threshold flag: a finite number >= 0."""
  require(checks.is_number(value) and math.isfinite(value) and value >= 0,
          "--%s=%r: must be a finite number >= 0 (%s)", name, value, off)


@dataclasses.dataclass(frozen=True)
class Flag(object):
  """One of a criterion's `//:train` flags (a `TrainParams` field).

  Attributes:
    name: the flag's and the field's name.
    default: the default (its type is the flag's: str, int, float, bool).
    help: the help text (--help, the docs' flags table).
  """
  name: str
  default: object
  help: str


@dataclasses.dataclass(frozen=True)
class CriterionSpec(object):
  """A library criterion, declared once.

  Attributes:
    reason: its label (`Criterion.reason`): counters `<reason>_skips`.
    flags: its `Flag`s, the one switching it on first.
    group: the title of its flags' group in `//:train --help`.
    check: `check(params)` raises `SpecError` for a bad value of its flags
      (params: any object with the flags as attributes, e.g. `TrainParams`;
      no TensorFlow).
    config: `config(params)`: what its class is built from, or None when
      its flags leave it off (the graph is then the one without it).
    criterion: "module:Class" of the `criteria.Criterion` built as
      `Class(config)` (its module imported only then).
    keyword: the wrapper's keyword (`SkipNonFiniteOptimizer(opt,
      <keyword>=value)`); default: the first flag's name.
    keyword_config: `keyword_config(value)`, the config of a keyword's
      value (raises ValueError for a bad one); default: the value itself.
  """
  reason: str
  flags: tuple
  group: str
  check: object
  config: object
  criterion: str
  keyword: str = None
  keyword_config: object = None

  @property
  def wrapper_keyword(self):
    return self.keyword or self.flags[0].name

  def build(self, config):
    """The criterion of `config` (imports its module: TensorFlow)."""
    module, name = self.criterion.split(":")
    return getattr(importlib.import_module(module), name)(config)

  def from_keyword(self, value):
    """The config of the wrapper's `<keyword>=value`, checked."""
    return self.keyword_config(value) if self.keyword_config else value
