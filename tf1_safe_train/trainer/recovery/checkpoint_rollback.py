"""Checkpoint rollback: an older checkpoint restored instead of giving up.

With `--on_persistent_skips=rollback`, when `--max_consecutive_skips` steps
in a row are skipped, `RollbackHook` restores (in the same session) the
newest checkpoint written at least `--rollback_min_applied_steps` applied
steps before the streak began, and training goes on; after
`--max_rollbacks` rollbacks (or with no such checkpoint) it gives up as
`core.hooks.GiveUpHook` does, with one line saying why.

What a rollback restores and what it keeps (the choices, and why):
  - restored: the model, its optimizer slots, statistics, shadows, EMA, the
    loss scale and `applied_steps` (the updates the model holds);
  - kept live: the run's history, as `state_rules.RULES` lists it:
    `global_step` (it counts batches consumed and the README promises it
    only grows, so `--max_steps` still ends the run), the other skip
    counters, the per-tower counts (non-finite, rejected, suspect faults),
    the longest streak; the rollbacks' own state
    (`checkpoint_rollback_state`). The streak (`consecutive_skips`)
    restarts at 0. `rolled_back_steps`
    counts the applied steps undone, so every checkpoint holds
    global_step == applied_steps + skipped_steps + rolled_back_steps
    (when skips advance global_step).
  - the input: the iterator is not in checkpoints, so in this process it is
    already past the batches fed since the restored checkpoint (the window
    that led to the streak): they are not fed again. A restarted process
    starts its input afresh: the window's example ids (kept per step by the
    hook, `checkpoint_rollback_window`) are appended durably to the
    train_dir before the rollback, and the startup exclusion drops them.
In a sync cluster the chief rolls back between an aggregate's update and
its tokens instead (`sync_point`, run by `cluster.sync_rollback`), and
every worker's hook only gives up on a streak it could not roll back.
A rollback changes only the session's variables: the next checkpoint
records it. A SIGKILL before then resumes from the last checkpoint, which
holds the streak, and the same rollback happens again.
"""

import os
import threading

from absl import logging
import tensorflow as tf

from tf1_safe_train.core import hooks as core_hooks
from tf1_safe_train.trainer.checkpoint import checkpoint_fit
from tf1_safe_train.trainer.recovery import checkpoint_rollback_state
from tf1_safe_train.trainer.recovery import checkpoint_rollback_target
from tf1_safe_train.trainer.inputs import checkpoint_rollback_window
from tf1_safe_train.trainer.config import one_machine_only
from tf1_safe_train.trainer.recovery import state_rules
from tf1_safe_train.trainer.inputs import tower_input

tf1 = tf.compat.v1


def act_on_model_fault(hook, run_context, step):
  """A replay's "the model, not the data" verdict at `step`: roll back
  after this step whatever the streak (`hook` a `RollbackHook`), else stop
  after it (`give_up_hook`'s hook, `--on_persistent_skips=stop`).

  Returns:
    True if it stopped the run (False: the `RollbackHook` acts).
  """
  if isinstance(hook, RollbackHook):
    hook.act_now(step)
    return False
  run_context.request_stop()
  return True


def model_fault(hook, forensics_hook):
  """The step of the model verdict the run ended on, or None."""
  if isinstance(hook, RollbackHook):
    return hook.model_fault
  return forensics_hook.model_fault


def refusal_in_cluster(params):
  """Why --on_persistent_skips=rollback cannot run in a cluster (one line),
  or None: `one_machine_only.rollback_refusal`."""
  return one_machine_only.rollback_refusal(params)


def give_up_hook(params, streak, step):
  """The hook that acts on a skip streak: `GiveUpHook`, or `RollbackHook`.

  Args:
    params: the run's `params.TrainParams`.
    streak: int tensor read after the step, the streak that counts.
    step: the run's `train_step.Step`.
  """
  if params.on_persistent_skips != "rollback":
    return core_hooks.GiveUpHook(streak, params.max_consecutive_skips,
                                 setting="--max_consecutive_skips")
  return RollbackHook(params, streak, step)


class RollbackHook(core_hooks.GiveUpHook):
  """Rolls back on a streak of --max_consecutive_skips skips, or gives up.

  `gave_up` as for `GiveUpHook`; `refusal` says why no rollback was done
  then; `records` lists this process's rollbacks (run_summary.json).
  `attach` must be called before the session starts (it builds the restore).
  """

  def __init__(self, params, streak, step):
    super(RollbackHook, self).__init__(streak, params.max_consecutive_skips,
                                       setting="--max_consecutive_skips")
    self._params = params
    self._step = step
    self._state = checkpoint_rollback_state.state()
    with tf1.control_dependencies([step.train_op]):
      reads = checkpoint_rollback_state.State(
          *[tf.identity(v.read_value()) for v in self._state])
    self._fetches = {"streak": streak, "global_step": step.totals[
        "global_step"], "counters": step.counters, "state": reads,
                     # A few bytes per example: the window's ids.
                     "step_index": step.step_index,
                     "ids": tf1.get_collection(
                         tower_input.EXAMPLE_IDS_COLLECTION)}
    self._ring = checkpoint_rollback_window.IdsRing(
        checkpoint_rollback_window.ring_steps(
            checkpoint_rollback_target.keep_checkpoint_max(params),
            params.save_checkpoints_steps, params.max_consecutive_skips))
    self._restorer = None
    self._after = None
    self.refusal = None
    self.records = []
    self.latest_state = None
    self._final = None  # Counters a rollback after the last step changed.
    self._now = None  # The step of a model verdict to act on.
    self._synced = False  # Rolls back at the sync point (`sync_point`).
    # Held by the ring's reads and writes and by the restore: a sync
    # point's thread restores while the chief's hooks run (the run's saver
    # holds it too: no checkpoint of a half-restored model).
    self.lock = threading.RLock()
    self._point_reads = None
    self.model_fault = None  # The one the run gave up on.

  def act_now(self, step):
    """Acts after this step whatever the streak: a replay found that every
    batch fails on these weights at `step` (`act_on_model_fault`)."""
    self._now = step

  def attach(self, resume):
    """Builds the restore (before the graph is finalized).

    Args:
      resume: the checkpoint the run resumes from (its names are the ones
        every checkpoint of the run uses), or None.
    """
    # History is kept, model state restored: one list (`state_rules`),
    # which every counter of the step must be in.
    counters = self._step.variables["counters"]
    step_variables = []
    for value in self._step.variables.values():
      step_variables.extend(value if isinstance(value, tuple) else [value])
    unlisted = state_rules.unlisted(step_variables)
    if unlisted:
      raise ValueError("state_rules.RULES does not say whether a rollback "
                       "keeps or restores %s" % ", ".join(unlisted))
    kept = set(id(v) for v in state_rules.kept_on_rollback())
    restored = [v for v in tf1.global_variables() if id(v) not in kept]
    self._restorer = tf1.train.Saver(
        var_list=checkpoint_fit.names_in(resume, restored),
        name="rollback_restore")
    with tf1.name_scope("rollback"):
      self._undone = tf1.placeholder(tf.int64, [], "undone")
      self._to_step = tf1.placeholder(tf.int64, [], "to_step")
      factor = 0.5 if self._params.rollback_halve_learning_rate else 1.0
      s = self._state
      self._after = tf.group(
          tf1.assign(counters.consecutive_skips, tf.constant(0, tf.int64)),
          tf1.assign_add(s.rolled_back_steps, self._undone),
          tf1.assign_add(s.rollbacks, tf.constant(1, tf.int64)),
          tf1.assign(s.rollback_to_step, self._to_step),
          tf1.assign(s.learning_rate_multiplier,
                     s.learning_rate_multiplier * factor))
    if self._synced:
      # Plain reads: the point runs in the chief's queue runner, which the
      # chief's own step (what `_fetches` are ordered after) waits for.
      self._point_reads = {
          "streak": _unordered_read(self._fetches["streak"]),
          "global_step": self._step.variables["global_step"].read_value(),
          "applied": counters.applied_steps.read_value(),
          "state": [v.read_value() for v in self._state]}

  def after_create_session(self, session, coord):
    del coord
    # The state the run resumed from: a rerun that runs no step (the run had
    # ended) reports the whole run's counts all the same.
    self.latest_state = session.run(self._state)._asdict()

  def sync_point(self):
    """The rollback of a sync cluster: `point(session)`, to run after each
    aggregate's update and before the next step's tokens.

    The chief's queue runner runs it (`cluster.sync_rollback`): no replica
    reads the weights or pushes gradients on them until the tokens are
    there, so the restore interleaves with no update, and gradients pushed
    before it are older than the global step (kept: history) and the
    accumulators drop them. From then on `after_run` (every worker's) never
    rolls back itself: a streak it still sees at the limit is one the point
    could not roll back, and the run gives up. Call it before `attach`.
    """
    self._synced = True
    return self._at_sync_point

  def _at_sync_point(self, session):
    if self.refusal or not self._max:
      return
    reads = session.run(self._point_reads)
    if reads["streak"] < self._max:
      return
    state = checkpoint_rollback_state.State(*reads["state"])
    at_step, applied = int(reads["global_step"]), int(reads["applied"])
    chosen = self._choose(at_step, applied, state)
    if isinstance(chosen, str):
      self.refusal = chosen  # The workers' `after_run` gives up on it.
      return
    self._rollback(session, chosen[0], at_step, chosen[1], chosen[2])

  def _choose(self, at_step, applied, state):
    """(path, to_step, applied steps undone), or why not (a str)."""
    params = self._params
    if state.rollbacks >= params.max_rollbacks:
      return "no rollback: --max_rollbacks=%d used up" % params.max_rollbacks
    path, to_step, ckpt_applied = (
        checkpoint_rollback_target.choose_checkpoint(
            params.train_dir, at_step,
            applied - params.rollback_min_applied_steps, int(state.rollbacks),
            int(state.rollback_to_step)))
    if path is None:
      return "no rollback: " + checkpoint_rollback_target.no_checkpoint_reason(
          params, applied)
    return path, to_step, applied - ckpt_applied

  def after_run(self, run_context, run_values):
    if not self._fetched:
      return
    results = run_values.results
    with self.lock:
      self._ring.add(int(results["step_index"]), results["ids"])
    self.latest_state = results["state"]._asdict()
    self._final = None
    streak = int(results["streak"])
    now, self._now = self._now, None
    if now is None and (not self._max or streak < self._max):
      return
    if self._synced:
      # The chief's point did not roll back (it set why) or, on another
      # worker, the chief's log says why.
      self._give_up(run_context, streak, now, self.refusal or
                    "no rollback: the chief's sync point did not roll back "
                    "(its log says why)")
      return
    chosen = self._choose(int(results["global_step"]),
                          int(results["counters"].applied_steps),
                          results["state"])
    if isinstance(chosen, str):
      self._give_up(run_context, streak, now, chosen)
      return
    self._rollback(run_context.session, chosen[0],
                   int(results["global_step"]), chosen[1], chosen[2])

  def _give_up(self, run_context, streak, now, refusal):
    self.refusal = refusal
    self.gave_up = True
    self.model_fault = now
    logging.error("giving up: %d consecutive steps skipped "
                  "(--max_consecutive_skips=%d); %s", streak, self._max,
                  self.refusal)
    run_context.request_stop()

  def _rollback(self, session, path, at_step, to_step, undone):
    """Restores `path` in `session` and records it."""
    # Durable before the restore, so before any checkpoint recording it.
    with self.lock:
      ids, unknown = self._ring.window(to_step, at_step - 1)
      checkpoint_rollback_window.append(self._params.train_dir, at_step,
                                        [to_step, at_step - 1], ids, unknown)
      self._restorer.restore(session, path)
      session.run(self._after, {self._undone: undone,
                                self._to_step: to_step})
      state_now, counters = session.run(
          [self._state, self._step.variables["counters"]])
    self.latest_state = state_now = state_now._asdict()
    self._final = {"applied_steps": int(counters.applied_steps),
                   "consecutive_skips": int(counters.consecutive_skips)}
    left = self._params.max_rollbacks - int(state_now["rollbacks"])
    record = {
        "at_step": at_step, "to_step": to_step,
        "checkpoint": os.path.basename(path),
        # The batches of global steps [to_step, at_step): fed since the
        # checkpoint, the streak included; this process feeds none again.
        "batches_skipped": at_step - to_step,
        "data_window": [to_step, at_step - 1],
        "window_examples": len(ids), "window_steps_without_ids": unknown,
        "applied_steps_undone": undone, "rollbacks_left": left,
        "learning_rate_multiplier": float(
            state_now["learning_rate_multiplier"])}
    self.records.append(record)
    logging.warning(
        "rolled back at step %d to %s (step %d): %d applied steps undone, "
        "the batches of steps %d-%d skipped, learning rate x%g, %d "
        "rollback%s left", at_step, record["checkpoint"], to_step, undone,
        to_step, at_step - 1, record["learning_rate_multiplier"], left,
        "" if left == 1 else "s")

  def summary_fields(self):
    """The run summary's rollback fields."""
    fields = {"rollbacks": self.records}
    if self.latest_state is not None:
      # The records are this process's; the counts are the whole run's.
      fields["rollback_count"] = int(self.latest_state["rollbacks"])
      fields["rolled_back_steps"] = int(self.latest_state["rolled_back_steps"])
      fields["learning_rate_multiplier"] = float(
          self.latest_state["learning_rate_multiplier"])
      # The checkpoint the model descends from (-1: none): the give-up
      # line's last good one follows it (`checkpoint_rollback_target`).
      fields["rollback_to_step"] = int(
          self.latest_state["rollback_to_step"])
    if self.refusal:
      fields["rollback_refused"] = self.refusal
    fields.update(self._final or {})
    return fields


def _unordered_read(tensor):
  """A fresh read of the variable `tensor` reads (through `tf.identity`s),
  without the control dependencies that order `tensor` after a step."""
  op = tensor.op
  while op.type == "Identity":
    op = op.inputs[0].op
  if op.type == "ReadVariableOp":
    return tf.raw_ops.ReadVariableOp(resource=op.inputs[0],
                                     dtype=op.get_attr("dtype"))
  if op.type == "VariableV2":  # A ref variable: its value, read anew.
    return tf.identity(op.outputs[0])
  raise ValueError("the streak %s is no read of a variable" % tensor.name)


def summary_fields(hook):
  """The run summary's rollback fields of `give_up_hook`'s hook ({} if none)."""
  return hook.summary_fields() if isinstance(hook, RollbackHook) else {}
