"""What a run of a guarded step is told, each time with the line to add.

`write_check.findings` says what a run does that a skip cannot undo or
count once; the lines here name it (the variables, the steps, the
global_step and its other writer) and the one line that fixes it. `tell`
logs each finding once per graph, however many runs, hooks or checks meet
it; with `strict=True` it refuses the run instead, before anything runs.
"""

import re

from absl import logging

from tf1_safe_train.core import user_words

# Graph attribute: the findings already told in this graph.
_TOLD_ATTRIBUTE = "_tf1_safe_train_told"
# Graph attribute: the ops `protect()` returned (`note_protected`).
_PROTECTED_ATTRIBUTE = "_tf1_safe_train_protected"
# Op names TensorFlow gives by default, not the script: a line of code
# says `train_op` for such a fetch instead.
_DEFAULT_NAMES = frozenset([
    "group_deps", "ExponentialMovingAverage", "NoOp", "Identity",
    "protected", "unchanged", "protect_value"])
# Where to turn the first-run check off (said in every warning).
_OFF = ("SkipNonFiniteOptimizer(..., check_runs=False) turns this "
        "first-run check off")


def _chosen(op):
  """True if the script chose `op`'s name (not "group_deps", "Identity_2")."""
  last = op.name.split("/")[-1]
  base = re.sub(r"_[0-9]+$", "", last)
  return (last.isidentifier() and base not in _DEFAULT_NAMES and
          base != op.type)


def _what_runs(ops):
  """The fetched ops a message names, e.g. "'train_op'" (or what the
  script calls them, "`train_op`", for a name TensorFlow chose)."""
  names = set()
  for op in ops:
    name = None if _chosen(op) else user_words.fetch_name(op)
    names.add("`%s`" % name if name else "'%s'" % op.name)
  names = sorted(names)
  shown = ", ".join(names[:3])
  if len(names) > 3:
    shown += ", ..."
  return shown


def several_steps(ops, decisions):
  """The line for a run of several guarded steps (their `applied` tensors)."""
  return (
      "one session.run (of %s) executes %d guarded steps (%s), one per "
      "SkipNonFiniteOptimizer.apply_gradients call: each checks only its "
      "own gradients, decides and counts alone, so one step is counted %d "
      "times and one device's copy can apply while another's skips. Build "
      "the step once, with one wrapper, over every device's gradients: "
      "`train_op = opt.apply_gradients_per_device([grads_and_vars_0, "
      "grads_and_vars_1, ...], global_step, optimizers=[...])` "
      "(optimizers: optional, one per device as the script had)" % (
          _what_runs(ops), len(decisions),
          ", ".join(d.op.name for d in decisions), len(decisions)))


def _words(op):
  """What to call fetched `op` in a line of code: the script's name for
  it, else its op name if the script chose that (not "group_deps")."""
  name = user_words.fetch_name(op)
  if name:
    return name
  return op.name.split("/")[-1] if _chosen(op) else "train_op"


def _protect_line(op, holder):
  """"`x = opt.protect(x)`", in the script's words, and who holds it."""
  name = _words(op)
  line = "`%s = %s.protect(%s)`" % (name, holder.expression, name)
  if holder.wrapper:
    line += (" (protect is the SkipNonFiniteOptimizer's, which your %s "
             "wraps; the %s has none)" % (holder.wrapper, holder.wrapper))
  return line


def unguarded(ops, names, holder=None, protected=False):
  """The line for variables a run writes outside the skip decision.

  Args:
    ops: the fetched ops that run the step.
    names: the variables' names.
    holder: `user_words.Holder`: what holds `protect`.
    protected: `ops` are `protect()`'s already (advice must not loop).
  """
  said = ("the train op writes %d variable(s) outside the skip decision, "
          "which change on skipped steps too: %s. " % (len(names),
                                                       ", ".join(names)))
  if protected:
    return said + (
        "protect() has run over what you run (%s here) and cannot undo "
        "them (writes it cannot follow: in a loop or a function call): "
        "build them outside those, or let them change on skipped steps" %
        _what_runs(ops))
  return said + (
      "Add one line after building what you run (%s here): %s (a tensor, "
      "such as tf-slim's train_tensor, stays a tensor), which undoes those "
      "writes on a skipped step" % (
          _what_runs(ops), _protect_line(ops[0], holder or
                                         user_words.Holder())))


def other_fetch(op, names, holder=None):
  """The line for another fetch whose writes read what the step writes."""
  name = user_words.fetch_name(op)
  return (
      "%s, fetched with the train op, writes %d variable(s) from what the "
      "guarded step writes, which change on skipped steps too: %s. Add one "
      "line after building it: %s, which undoes those writes on a skipped "
      "step (it then runs the step too: fetch it with the train op "
      "only)" % ("`%s` ('%s')" % (name, op.name) if name else
                 "'%s'" % op.name, len(names), ", ".join(names),
                 _protect_line(op, holder or user_words.Holder())))


def between_steps(ops, names, steps=()):
  """The line for a run of no step that writes restored statistics (those
  of `steps`, `write_check.Step`s, if given: the step to fetch it with)."""
  step = "train_op"
  for s in steps:
    if set(names) & set(s.handled_names):
      step = user_words.fetch_name(
          getattr(s.train_op, "op", s.train_op)) or step
      break
  return (
      "a run of %s executes no guarded step but writes %d statistic(s) a "
      "skip restores: %s. The next skipped step undoes what it wrote, and "
      "a NaN it writes (a bad batch) makes the next step skip too. Fetch "
      "it with the step, `sess.run([%s, %s], feed_dict)`, or build "
      "it with batch norm not training" % (
          _what_runs(ops), len(names), ", ".join(names), step,
          _words(ops[0])))


def global_step_twice(name, others):
  """The line for a global_step the step and the script both advance."""
  return (
      "%s is advanced twice per step: by the guarded step "
      "(apply_gradients(..., global_step=%s)) and by %s outside it (the "
      "script's own increment), so learning-rate schedules run twice as "
      "fast and skip lines name the wrong step. Keep one: call "
      "`opt.apply_gradients(grads_and_vars)` without global_step= (your "
      "increment then counts every step, skipped ones too), or drop your "
      "increment" % (name, name, ", ".join(others)))


def note_protected(op):
  """Notes an op `protect()` returned (advice never says to protect it)."""
  graph = op.graph
  if not hasattr(graph, _PROTECTED_ATTRIBUTE):
    setattr(graph, _PROTECTED_ATTRIBUTE, set())
  getattr(graph, _PROTECTED_ATTRIBUTE).add(op)


def lines(ops, found, steps=()):
  """(key, line) of each finding of `found` (`write_check.Findings`);
  `steps`: the graph's watched steps, for a run that executes none."""
  told = []
  holder = user_words.holder(found.steps)
  if len(found.steps) > 1:
    told.append((("steps",) + tuple(s.applied.op.name for s in found.steps),
                 several_steps(found.runners, [s.applied for s in found.steps])))
  if found.unguarded:
    done = getattr(ops[0].graph, _PROTECTED_ATTRIBUTE, ())
    told.append((("writes",) + tuple(found.unguarded),
                 unguarded(found.runners, found.unguarded, holder,
                           any(op in done for op in found.runners))))
  for op, names in found.others:
    told.append((("other", op.name) + tuple(names),
                 other_fetch(op, names, holder)))
  for name, others in found.global_steps:
    told.append((("global_step", name) + tuple(others),
                 global_step_twice(name, others)))
  if found.between:
    told.append((("between",),  # Once per graph: one line.
                 between_steps(ops, found.between, steps)))
  return told


def tell(ops, found, strict, steps=()):
  """Logs each finding once per graph; strict: raises on the first one.

  Args:
    ops: the Operations the run fetches.
    found: its `write_check.Findings`.
    strict: raise instead of warning.
    steps: the graph's watched `write_check.Step`s (named in the line for
      a run that executes none).

  Raises:
    ValueError: if `strict` and there is a finding (every time: the run
      does not happen).
  """
  told = lines(ops, found, steps) if ops else []
  if not told:
    return
  graph = ops[0].graph
  said = getattr(graph, _TOLD_ATTRIBUTE, None)
  if said is None:
    said = set()
    setattr(graph, _TOLD_ATTRIBUTE, said)
  for key, line in told:
    if strict:
      raise ValueError(line)
    if key not in said:
      said.add(key)
      logging.warning("tf1_safe_train: %s (%s)", line, _OFF)
