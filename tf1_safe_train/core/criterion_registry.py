"""The library's skip criteria with a flag: one line each (`SPECS`).

From here the trainer takes its criteria's params, flags, --help groups
and early checks (`trainer/config/params.py`, `trainer/config/param_validation.py`,
`trainer/config/flag_groups.py`), builds the criteria a run's params switch on
(`from_params`), and the wrapper takes their keywords
(`SkipNonFiniteOptimizer(opt, skip_spikes=6)`: `from_keywords`). A new
library criterion is its module, its spec (`criterion_spec`) and one line
in `SPECS`; `register` adds one at run time (e.g. a test's). No TensorFlow.
"""

import importlib

# "module" holding a `SPEC`, in the order their flags are listed.
SPECS = [
    "tf1_safe_train.core.spikes_spec",
    "tf1_safe_train.core.grad_norm_spec",
    "tf1_safe_train.core.tower_outliers_spec",
]

_specs = []
# (on register, on unregister) pairs.
_listeners = []


def register(spec):
  """Adds `spec` (a `criterion_spec.CriterionSpec`, or the name of a module
  holding one as `SPEC`) to every place listed above; returns it."""
  if isinstance(spec, str):
    spec = importlib.import_module(spec).SPEC
  taken = {s.reason for s in _specs} | {"nonfinite"}
  flags = {f.name for s in _specs for f in s.flags}
  if spec.reason in taken or flags & {f.name for f in spec.flags}:
    raise ValueError("criterion %r: its reason or a flag is taken" %
                     (spec.reason,))
  for listener, _ in _listeners:
    listener(spec)  # (Raises for a flag taken there: nothing registered.)
  _specs.append(spec)
  return spec


def unregister(spec):
  """Takes back a `register(spec)` (e.g. a test's criterion)."""
  _specs.remove(spec)
  for _, listener in _listeners:
    listener(spec)


def specs():
  """The registered `CriterionSpec`s, in order."""
  return tuple(_specs)


def on_register(listener, on_unregister):
  """Calls `listener(spec)` for every spec, now and when registered, and
  `on_unregister(spec)` when one is unregistered."""
  _listeners.append((listener, on_unregister))
  for spec in _specs:
    listener(spec)


def check(params):
  """Runs every spec's check of `params` (raises `SpecError`)."""
  for spec in _specs:
    spec.check(params)


def from_params(params):
  """The criteria `params` switch on (builds them: TensorFlow)."""
  configs = [(s, s.config(params)) for s in _specs]
  return [s.build(c) for s, c in configs if c is not None]


def from_keywords(keywords):
  """[(spec, config)] of the wrapper's criterion keywords, checked.

  Raises:
    TypeError: for a keyword no spec takes.
  """
  by_keyword = {s.wrapper_keyword: s for s in _specs}
  unknown = sorted(set(keywords) - set(by_keyword))
  if unknown:
    raise TypeError("SkipNonFiniteOptimizer got unexpected keyword "
                    "argument(s) %s (criteria's: %s)" % (
                        ", ".join(unknown), ", ".join(sorted(by_keyword))))
  return [(by_keyword[k], by_keyword[k].from_keyword(v))
          for k, v in keywords.items() if v is not None]


for _name in SPECS:
  register(_name)
