"""The trainer's options that run on one machine only, refused in a cluster.

(Rollback runs in a sync cluster, and is refused in an async one.)

Each refusal is one line saying why; every task of a cluster refuses them
before it starts. This module imports no TensorFlow, so that `//:train`
refuses them before TensorFlow's import (`preflight`), and again where the
run is built (`train_lib.train`).
"""


def rollback_refusal(params):
  """Why --on_persistent_skips=rollback cannot run in a cluster, or None.

  With --sync_replicas it runs: the chief restores between an aggregate's
  update and the next step's tokens, when no replica can read or update
  the model (`cluster.sync_rollback`). Async workers update the parameter
  servers whenever they like: one worker's restore would be overwritten
  behind it, or overwrite the others' updates; pausing every worker is not
  implemented, so it is refused.
  """
  if params.on_persistent_skips != "rollback" or params.sync_replicas:
    return None
  return ("--on_persistent_skips=rollback in a cluster needs "
          "--sync_replicas: an async worker's restore would overwrite the "
          "parameter servers' live state behind the other workers; add "
          "--sync_replicas or use --on_persistent_skips=stop")


def tower_unit_refusal(params):
  """Why --skip_unit=tower cannot run in a cluster, or None.

  A sync chief averages the workers' aggregate and an async worker applies
  on the parameter servers: neither sees the towers of the other workers to
  leave one out, and leaving out one worker's own tower would hide it from
  the others' decision. Refused rather than half done.
  """
  if params.skip_unit != "tower":
    return None
  return ("--skip_unit=tower runs on one machine only: in a cluster the "
          "decision does not see every worker's towers; use --skip_unit=step")


def refusal(params):
  """The first of the refusals above that `params` meet, or None."""
  return rollback_refusal(params) or tower_unit_refusal(params)
