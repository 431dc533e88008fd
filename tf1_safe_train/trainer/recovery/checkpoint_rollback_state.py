"""A checkpoint rollback's bookkeeping (checkpointed), and the rate it sets.

`State` counts a run's rollbacks and the applied steps they undid, and holds
the step of the checkpoint the last one restored and the learning-rate
multiplier they set. Every checkpoint holds it: a restarted run keeps it,
and `checkpoint_rollback_target` reads the model's history from it.
"""

import collections

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import criteria

tf1 = tf.compat.v1

_STATE_COLLECTION = "tf1_safe_train_rollback_state"

State = collections.namedtuple("State", [
    "rolled_back_steps", "rollbacks", "rollback_to_step",
    "learning_rate_multiplier"])
State.__doc__ = """The rollback bookkeeping of a run (checkpointed variables).

Attributes:
  rolled_back_steps: int64, applied steps undone by rollbacks.
  rollbacks: int64, rollbacks done (at most --max_rollbacks per run).
  rollback_to_step: int64, global_step of the checkpoint the last rollback
    restored (-1: none), which says which older checkpoints are ancestors
    of the current model (`checkpoint_rollback_target.choose_checkpoint`).
  learning_rate_multiplier: float32, halved by each rollback with
    --rollback_halve_learning_rate (1 otherwise).
"""


def state(graph=None):
  """The graph's `State`, creating it on first use (at the graph's root)."""
  graph = graph or tf1.get_default_graph()
  existing = graph.get_collection(_STATE_COLLECTION)
  if existing:
    return State(*existing)
  initial = State(np.int64(0), np.int64(0), np.int64(-1), np.float32(1))
  # Optional state: a run that gave up with --on_persistent_skips=stop (its
  # checkpoints lack these) resumes with rollback, starting from `initial`.
  with graph.as_default(), tf1.init_scope(), graph.name_scope(None):
    variables = [tf1.Variable(
        value, name=name, trainable=False,
        collections=[tf1.GraphKeys.GLOBAL_VARIABLES, _STATE_COLLECTION,
                     criteria.OPTIONAL_STATE])
                 for name, value in initial._asdict().items()]
  result = State(*variables)
  tf1.summary.scalar("skips/rolled_back_steps", result.rolled_back_steps)
  tf1.summary.scalar("skips/rollbacks", result.rollbacks)
  return result


def scale_learning_rate(params, learning_rate):
  """`learning_rate` times the rollbacks' multiplier (with rollback on).

  The multiplier is a checkpointed variable, so a restart keeps the rate a
  rollback halved. Without rollback the graph is unchanged (and so are its
  checkpoints).
  """
  if params.on_persistent_skips != "rollback":
    return learning_rate
  return learning_rate * state().learning_rate_multiplier

