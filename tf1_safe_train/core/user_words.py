"""The names a script gave what the first-run check's advice is about.

Advice reads best in the script's own words: `train_tensor =
optimizer.protect(train_tensor)` in tf-slim, not `train_op =
opt.protect(train_op)`. `note_holder` finds, when a step is built, what
holds `protect` (the `SkipNonFiniteOptimizer`, or the optimizer that wraps
it and the attribute that reaches it) and what the script calls it;
`fetch_name` finds, when a run is told, what the script calls a fetch.
Both read the local variables of the script's frames on the call stack
(frames of installed packages, the standard library and this package are
not the script's); where nothing is found the advice stays generic.
"""

import os
import sys
import sysconfig

# Graph attribute: {step's decision op: `Holder`}.
_HOLDERS_ATTRIBUTE = "_tf1_safe_train_holders"
# Attributes through which an optimizer holds the one it wraps
# (SyncReplicasOptimizer: `_opt`; loss-scale optimizers: `_optimizer`).
_WRAPPED_ATTRIBUTES = ("_opt", "_optimizer")
_MAX_DEPTH = 4
# Locals that name an object inside its own methods, not in the script.
_NOT_NAMES = frozenset(["self", "cls"])
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARIES = tuple(
    p for p in {sysconfig.get_paths().get(k) for k in
                ("stdlib", "platstdlib", "purelib", "platlib")} if p)


def _is_script(frame):
  """True for a frame of the script (a file, a notebook cell, `-c`)."""
  path = os.path.abspath(frame.f_code.co_filename)
  return not (path.startswith(_OURS + os.sep) or path.startswith(_LIBRARIES)
              or "site-packages" in path or "<frozen " in path)


def _frames():
  frame = sys._getframe(2)  # pylint: disable=protected-access
  while frame is not None:
    yield frame
    frame = frame.f_back


def _script_name(matches):
  """The innermost script local whose value `matches`, or None."""
  for frame in _frames():
    if _is_script(frame):
      for name, value in list(frame.f_locals.items()):
        if name not in _NOT_NAMES and not name.startswith("_") and (
            matches(value)):
          return name
  return None


def _attribute(obj, name):
  try:
    return getattr(obj, name, None)
  except Exception:  # pylint: disable=broad-except
    return None  # A property that cannot be read here.


def _path_to(obj, target, depth=0):
  """Attribute names from `obj` to `target` through wrapped optimizers."""
  for attribute in _WRAPPED_ATTRIBUTES:
    inner = _attribute(obj, attribute)
    if inner is target:
      return [attribute]
    if inner is not None and depth < _MAX_DEPTH:
      rest = _path_to(inner, target, depth + 1)
      if rest:
        return [attribute] + rest
  return None


class Holder(object):
  """What holds `protect` for a step, in the script's words.

  Attributes:
    expression: what to call `protect` on, e.g. "optimizer" or
      "opt._opt" (default "opt").
    wrapper: the class name of an optimizer that wraps ours, or None.
  """

  def __init__(self, expression="opt", wrapper=None):
    self.expression = expression
    self.wrapper = wrapper


def note_holder(step, wrapper):
  """Notes, while `step` (a `write_check.Step`) is built by `wrapper` (the
  `SkipNonFiniteOptimizer` whose `protect` keys on it), what holds
  `protect` for it; a no-op where the stack does not tell."""
  ours, wrapping = None, None
  for frame in _frames():
    owner = frame.f_locals.get("self")
    if owner is None:
      continue
    if ours is None and owner is wrapper:
      ours = owner
    elif ours is not None and owner is not ours:
      path = _path_to(owner, ours)
      if path:
        wrapping = (owner, path)  # The outermost wins.
  if ours is None:
    return
  name = _script_name(lambda v: v is ours)
  holder = Holder(name or "opt")
  if wrapping is not None:
    owner, path = wrapping
    holder.wrapper = type(owner).__name__
    outer = _script_name(lambda v: v is owner)
    if name is None and outer is not None:
      holder.expression = ".".join([outer] + path)
  graph = step.applied.graph
  holders = getattr(graph, _HOLDERS_ATTRIBUTE, None)
  if holders is None:
    holders = {}
    setattr(graph, _HOLDERS_ATTRIBUTE, holders)
  holders[step.applied.op] = holder


def holder(steps):
  """The `Holder` noted for the first of `steps` (else a generic one)."""
  for step in steps:
    holders = getattr(step.applied.graph, _HOLDERS_ATTRIBUTE, {})
    if step.applied.op in holders:
      return holders[step.applied.op]
  return Holder()


def fetch_name(op):
  """What the script calls fetched `op` (or a tensor of it), or None."""

  def _is_op(value):
    try:
      return value is op or getattr(value, "op", None) is op
    except Exception:  # pylint: disable=broad-except
      return False  # A property that cannot be read here.

  return _script_name(_is_op)
