"""What a run of a guarded step is told, each time with the line to add.

`write_check.findings` says what a run does that a skip cannot undo or
count once; the lines here name it (the variables, the steps, the
global_step and its other writer) and the one line that fixes it. `tell`
logs each finding once per graph, however many runs, hooks or checks meet
it; with `strict=True` it refuses the run instead, before anything runs.
"""

from absl import logging

# Graph attribute: the findings already told in this graph.
_TOLD_ATTRIBUTE = "_tf1_safe_train_told"
# Where to turn the first-run check off (said in every warning).
_OFF = ("SkipNonFiniteOptimizer(..., check_runs=False) turns this "
        "first-run check off")


def _what_runs(ops):
  """The fetched ops a message names, e.g. "'train_op'"."""
  names = sorted(set(op.name for op in ops))
  shown = ", ".join("'%s'" % n for n in names[:3])
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


def unguarded(ops, names):
  """The line for variables a run writes outside the skip decision."""
  return (
      "the train op writes %d variable(s) outside the skip decision, which "
      "change on skipped steps too: %s. Add one line after building what "
      "you run (%s here): `train_op = opt.protect(train_op)` (a tensor, "
      "such as tf-slim's train_tensor, stays a tensor), which undoes those "
      "writes on a skipped step" % (len(names), ", ".join(names),
                                    _what_runs(ops)))


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


def lines(ops, found):
  """(key, line) of each finding of `found` (`write_check.Findings`)."""
  told = []
  if len(found.steps) > 1:
    told.append((("steps",) + tuple(s.applied.op.name for s in found.steps),
                 several_steps(found.runners, [s.applied for s in found.steps])))
  if found.unguarded:
    told.append((("writes",) + tuple(found.unguarded),
                 unguarded(found.runners, found.unguarded)))
  for name, others in found.global_steps:
    told.append((("global_step", name) + tuple(others),
                 global_step_twice(name, others)))
  return told


def tell(ops, found, strict):
  """Logs each finding once per graph; strict: raises on the first one.

  Args:
    ops: the Operations the run fetches.
    found: its `write_check.Findings`.
    strict: raise instead of warning.

  Raises:
    ValueError: if `strict` and there is a finding (every time: the run
      does not happen).
  """
  told = lines(ops, found) if ops else []
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
