"""Does a checkpoint fit the graph a run builds, and under which names.

A resume with another `--model`, `--num_towers`, `--precision`,
`--optimizer` or `--moving_average_decay` would fail deep in a restore:
`mismatch` names the first variable that does not fit and the flag that
probably differs. Variables renamed since older checkpoints were written
keep their former names (`names_in`), so those runs still resume; the
state of an option switched on at a resume (`criteria.OPTIONAL_STATE`, e.g.
--skip_spikes_sigma's statistics, --on_persistent_skips=rollback's state)
starts afresh (`fresh_variables`).
"""

import json
import os

import tensorflow as tf

from tf1_safe_train.core import criteria

tf1 = tf.compat.v1


# Variable-name fragments and the flag that adds them (first match wins).
_FLAG_HINTS = (
    ("ExponentialMovingAverage", "--moving_average_decay"),
    ("loss_scale", "--precision"),
    ("Momentum", "--optimizer"), ("Adam", "--optimizer"),
    ("RMSProp", "--optimizer"), ("beta1_power", "--optimizer"),
    ("beta2_power", "--optimizer"),
    ("nonfinite_steps_by_tower", "--num_towers"),
    ("rolled_back_steps", "--on_persistent_skips"),
    ("rollback", "--on_persistent_skips"),  # rollbacks, rollback_to_step
    ("learning_rate_multiplier", "--on_persistent_skips"),
)
_COMPARED_FLAGS = ("model", "num_towers", "precision", "optimizer",
                   "moving_average_decay", "on_persistent_skips")


def _previous_params(train_dir):
  try:
    with open(os.path.join(train_dir, "run_summary.json")) as f:
      return json.load(f).get("params") or {}
  except (OSError, ValueError, AttributeError):
    return {}


# Variables whose name in older checkpoints differs: name now -> former name.
# Adam's beta powers were created in the trainer's decision scope ("apply/")
# until the trainer shared the wrapper's step, which creates them where an
# unwrapped optimizer does; runs written before still resume.
_FORMER_NAMES = {"beta1_power": "apply/beta1_power",
                 "beta2_power": "apply/beta2_power"}


def names_in(checkpoint, variables):
  """Each of `variables` by its name in `checkpoint` (a `Saver`'s var_list).

  A variable absent from `checkpoint` under its name but present under a
  former name (`_FORMER_NAMES`) keeps the former name, for restoring and for
  the run's later saves alike.

  Args:
    checkpoint: the checkpoint the run resumes from, or None.
    variables: the variables to save and restore.

  Returns:
    A dict {name in the checkpoint: variable}.
  """
  shapes = (tf1.train.NewCheckpointReader(checkpoint)
            .get_variable_to_shape_map() if checkpoint else {})
  names = {}
  for v in variables:
    name = v.op.name
    former = _FORMER_NAMES.get(name)
    if name not in shapes and former in shapes:
      name = former
    names[name] = v
  return names


def fresh_variables(checkpoint, variables):
  """The optional state of `variables` that `checkpoint` lacks (a list).

  Such variables (`criteria.OPTIONAL_STATE`: the state of an option switched
  on at this resume) are not restored but initialised (`FiniteSaver`'s
  `fresh`): a run resumed with --skip_spikes_sigma warms up again.
  """
  if not checkpoint:
    return []
  shapes = tf1.train.NewCheckpointReader(
      checkpoint).get_variable_to_shape_map()
  optional = {id(v) for v in tf1.get_collection(criteria.OPTIONAL_STATE)}
  fresh = [v for name, v in names_in(checkpoint, variables).items()
           if id(v) in optional and name not in shapes]
  return fresh


def saver_var_list(checkpoint, variables):
  """`names_in`, or None when every name is today's (the Saver's default)
  and nothing starts afresh."""
  names = names_in(checkpoint, variables)
  if (all(name == v.op.name for name, v in names.items()) and
      not fresh_variables(checkpoint, variables)):
    return None
  return names


def _rollbacks_dropped(checkpoint, reader, shapes, params):
  """Why a run without rollback cannot resume a run that rolled back.

  The state of --on_persistent_skips=rollback is optional (a run that gave
  up with stop resumes with rollback), and a checkpoint's state that the
  graph lacks is merely unused: so a rollback run that never rolled back
  resumes with stop. One that did cannot: a graph without rollback has
  no rolled_back_steps nor learning rate multiplier, so its checkpoints
  would break global_step == applied + skipped + rolled back steps, the
  halved rate would be restored, and a later resume with rollback would
  take checkpoints of a window the rollback abandoned for ancestors.
  """
  if (params.on_persistent_skips == "rollback" or
      "rollbacks" not in shapes or not int(reader.get_tensor("rollbacks"))):
    return None
  rollbacks = int(reader.get_tensor("rollbacks"))
  undone = (int(reader.get_tensor("rolled_back_steps"))
            if "rolled_back_steps" in shapes else 0)
  return ("cannot resume from %s with --on_persistent_skips=%s: the run "
          "rolled back %d time%s (%d applied steps undone), which only "
          "--on_persistent_skips=rollback keeps counting (resume with it, "
          "e.g. with --max_rollbacks=%d to roll back no more, or use a new "
          "--train_dir)" % (checkpoint, params.on_persistent_skips, rollbacks,
                            "" if rollbacks == 1 else "s", undone, rollbacks))


def mismatch(checkpoint, variables, params):
  """Why `checkpoint` cannot restore `variables` (one line), or None.

  Args:
    checkpoint: the checkpoint the run resumes from.
    variables: the variables the saver restores.
    params: the run's `params.TrainParams`.

  Returns:
    The first missing or differently shaped variable and the flag that
    probably differs, as one line; None if every variable fits.
  """
  reader = tf1.train.NewCheckpointReader(checkpoint)
  shapes = reader.get_variable_to_shape_map()
  dropped = _rollbacks_dropped(checkpoint, reader, shapes, params)
  if dropped:
    return dropped
  problem = None
  fresh = {id(v) for v in fresh_variables(checkpoint, variables)}
  for name, v in names_in(checkpoint, variables).items():
    if id(v) in fresh:
      continue
    if name not in shapes:
      problem = name, "is not in it"
    elif list(shapes[name]) != v.shape.as_list():
      problem = name, "has shape %s there, %s here" % (shapes[name],
                                                       v.shape.as_list())
    if problem:
      break
  if problem is None:
    return None
  name, what = problem
  previous = _previous_params(os.path.dirname(checkpoint))
  differ = ["--%s=%s (now %s)" % (f, previous[f], getattr(params, f))
            for f in _COMPARED_FLAGS
            if f in previous and previous[f] != getattr(params, f)]
  if differ:
    hint = "the run that wrote it had " + ", ".join(differ)
  else:
    flag = next((f for frag, f in _FLAG_HINTS if frag in name), "--model")
    hint = "%s probably differs from the run that wrote it" % flag
  return ("cannot resume from %s: variable %s %s; %s (use the same flags, or "
          "a new --train_dir)" % (checkpoint, name, what, hint))
