"""`SyncReplicasOptimizer` and the wrapper, stacked either way round.

A synchronous step has two halves in two runs: each worker pushes its
gradients into `SyncReplicasOptimizer`'s accumulators and waits for a token;
the chief's queue runner applies the aggregate, then hands out the tokens.
Only the chief's half can hold the decision (it applies the aggregate);
only the worker's run writes what its forward pass updates (batch-norm
statistics). Outside (`SkipNonFiniteOptimizer(SyncReplicasOptimizer(opt))`,
`mnist_replica.py`'s order) the wrapper builds both halves: protected.
Inside (`SyncReplicasOptimizer(SkipNonFiniteOptimizer(opt))`, tf-slim's
`--sync_replicas`) it sees only the chief's: refused at graph build when
the graph has what it cannot protect there, naming the order that does.
"""

import sys

import tensorflow as tf

from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import guard
from tf1_safe_train.core import nonfinite
from tf1_safe_train.core import rollback
from tf1_safe_train.core import run_check
from tf1_safe_train.core import shadows
from tf1_safe_train.core import sync_statistics
from tf1_safe_train.core import write_check

tf1 = tf.compat.v1

# The ops whose outputs are a `SyncReplicasOptimizer`'s aggregated gradients.
_TAKE_GRADIENT_TYPES = frozenset([
    "AccumulatorTakeGradient", "ResourceAccumulatorTakeGradient",
    "SparseAccumulatorTakeGradient"])
# `SyncReplicasOptimizer`'s session API, which scripts call on the optimizer
# they built (`mnist_replica.py`; `slim.learning.train(sync_optimizer=)`): the
# wrapper outside answers them for it.
_SESSION_API = frozenset([
    "get_chief_queue_runner", "get_init_tokens_op", "make_session_run_hook",
    "chief_init_op", "local_step_init_op", "ready_for_local_init_op"])

ADVICE = ("opt = SkipNonFiniteOptimizer(tf.compat.v1.train."
          "SyncReplicasOptimizer(opt, ...))")


class SyncStacking(object):
  """`SkipNonFiniteOptimizer`'s side of a stack with `SyncReplicasOptimizer`."""

  def __init__(self, optimizer, last_step, build_step, protect, *,
               increment_global_step_on_skip, update_ops, strict):
    """Args: the wrapped optimizer (a `SyncReplicasOptimizer`: outside),
    the wrapper's `reporting.LastStep` (noting the worker's step), guarded
    step (`per_device.PerDeviceSteps`), `protect` (the chief's averages),
    and keywords."""
    self._optimizer = optimizer
    self._last_step = last_step
    self._build_step = build_step
    self._protect = protect
    self._increment_global_step_on_skip = increment_global_step_on_skip
    self._update_ops = update_ops
    self._strict = strict
    # True once a step was built inside a SyncReplicasOptimizer.
    self._inside = False

  def check_protect(self):
    """Refuses (ValueError) `protect` once a step was built inside a
    SyncReplicasOptimizer: it would hang."""
    if self._inside:
      # Its decision is the chief's queue runner's: a worker's train op
      # waiting for it would take the aggregate itself, or wait for ever.
      raise ValueError(
          "SkipNonFiniteOptimizer inside SyncReplicasOptimizer: protect() "
          "cannot key a worker's ops on the chief's decision (the run would "
          "never finish). Put the wrapper outside instead: `%s`, then "
          "`train_op = opt.protect(train_op)`" % ADVICE)

  def session_api(self, name):
    """The wrapped `SyncReplicasOptimizer`'s `name`, of its session API
    (else AttributeError)."""
    if name in _SESSION_API and isinstance(self._optimizer,
                                           tf1.train.SyncReplicasOptimizer):
      return getattr(self._optimizer, name)
    raise AttributeError(name)

  def step(self, grads_and_vars, global_step, name, losses):
    """(the result of a step stacked outside, or None; the step's losses).

    Outside: the worker's push and the chief's guarded step (`_outside`).
    Inside: refuses (ValueError) a graph whose statistics or averages the
    chief's step cannot protect; otherwise the chief's step is the usual
    one, built without the worker's losses (the chief never computes them).
    """
    outside = isinstance(self._optimizer, tf1.train.SyncReplicasOptimizer)
    if (outside or aggregated(grads_and_vars)) and not (
        self._increment_global_step_on_skip):
      # A skip that left global_step would leave the workers' next pushes
      # stale: the accumulators drop them, and the chief waits for ever.
      raise ValueError(
          "SkipNonFiniteOptimizer with SyncReplicasOptimizer needs "
          "increment_global_step_on_skip=True (the default): its workers' "
          "next gradients would be dropped as stale, and the step would "
          "never finish")
    if outside:
      self._outside(self._optimizer, grads_and_vars, global_step, name,
                    losses)
      return self._last_step.result, []
    if aggregated(grads_and_vars):
      worker_ops = []
      if self._update_ops is None:  # (The trainer pushes its statistics.)
        worker_ops = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        worker_ops += [op for op in rollback.update_ops_run_by(
            [loss.op for loss in losses]) if op not in worker_ops]
      check_inside(_calling_sync(), worker_ops)
      self._inside = True
      return None, []
    return None, losses

  def _outside(self, sync, grads_and_vars, global_step, name, losses):
    """The worker's push and, for the chief, the guarded apply of the aggregate.

    The worker pushes every step, finite or not: a push left out would keep
    the chief's aggregation (and every worker's token) waiting. The chief's
    apply of the aggregate is the wrapper's guarded step, with the
    `variable_averages` SyncReplicas would apply after it applied next to it
    and rolled back on a skip. The update ops the worker's step runs anyway
    (as for an unstacked step: `rollback.update_ops_run_by`) are rolled back
    after its token when its own gradients or their values were not finite
    or the chief skipped; `protect` keys on that too. Their writes are gated
    (`sync_statistics`): a non-finite value never reaches the ps.
    """
    if global_step is None:
      raise ValueError("SkipNonFiniteOptimizer(SyncReplicasOptimizer(...)): "
                       "apply_gradients needs global_step (SyncReplicas "
                       "checks staleness with it)")
    grads_and_vars = tuple(grads_and_vars)
    # The caller's control dependencies (the legacy update ops around
    # `apply_gradients`) are the worker's: its pushes wait for them. Built
    # under them, the chief's half would run the worker's forward pass.
    deps = rollback.step_roots([], "sync_worker_control_dependencies")
    # The chief's count of skips, read before the push and after the token.
    skipped = counters_lib.skip_counters().skipped_steps
    with tf1.control_dependencies(None):
      before = _snapshot(skipped)
      with tf1.control_dependencies(deps + [before]):
        pushes = [(_after_deps(g), v) for g, v in grads_and_vars]
    roots = rollback.step_roots(
        [g for g, _ in grads_and_vars if g is not None] + losses,
        "sync_worker_control_dependencies")
    updates = [rollback.as_op(u) for u in (
        rollback.update_ops_run_by(roots, [global_step])
        if self._update_ops is None else self._update_ops)]
    inner, averages = sync._opt, sync._variable_averages  # pylint: disable=protected-access
    sync._opt = _ChiefStep(self._build_step, self._protect, inner, averages,  # pylint: disable=protected-access
                           sync._variables_to_average)  # pylint: disable=protected-access
    sync._variable_averages = None  # pylint: disable=protected-access
    try:
      with tf1.control_dependencies(None):
        pushed = sync.apply_gradients(pushes, global_step, name)
    finally:
      sync._opt, sync._variable_averages = inner, averages  # pylint: disable=protected-access
    written, _ = sync_statistics.gate(sync, updates,
                                      [g for g, _ in grads_and_vars])
    view = _worker_view(grads_and_vars, updates)
    with tf1.control_dependencies([pushed]):
      after = _snapshot(skipped)
    # Applied: this worker's values were finite, written, and the chief's
    # decision between its push and its token (no spare token) was to apply.
    view = view._replace(applied=tf.reduce_all(tf.stack([
        view.applied, written, tf.equal(before, after)]),
                                               name="worker_applied"))
    last = self._last_step  # The chief's step, noted by `build_step`.
    # Never rolled back: a worker whose local step went back would push
    # stale gradients, which the accumulators drop, for ever.
    last.variables.append(sync._local_step)  # pylint: disable=protected-access
    train_op = tf.group(pushed, view.applied, name="sync_worker_step")
    if updates:
      train_op = tf.group(train_op, rollback.protect(
          updates, view.applied,
          frozenset(v.op.name for v in last.variables),
          name="sync_worker_statistics"))
    last.variables += rollback.written_variables(updates)
    handled = frozenset(v.op.name for v in last.variables)
    last.result = view._replace(train_op=train_op)
    run_check.watch(write_check.Step(view.applied, train_op, None, handled,
                                     self._strict))


def aggregated(grads_and_vars):
  """True if the gradients are a `SyncReplicasOptimizer`'s aggregates."""
  return any(g is not None and tf.nest.flatten(g, expand_composites=True)[
      0].op.type in _TAKE_GRADIENT_TYPES for g, _ in grads_and_vars)


def _calling_sync():
  """The `SyncReplicasOptimizer` whose `apply_gradients` calls the wrapper.

  Its `variable_averages` are applied after the wrapper's step returns, so
  only the caller knows of them (TF's code, frozen in tf.compat.v1).
  """
  frame = sys._getframe(1)  # pylint: disable=protected-access
  for _ in range(8):
    if frame is None:
      return None
    owner = frame.f_locals.get("self")
    if isinstance(owner, tf1.train.SyncReplicasOptimizer):
      return owner
    frame = frame.f_back
  return None


def check_inside(sync, worker_ops):
  """Refuses what the wrapper inside `sync` cannot keep on a skip.

  Its step runs in the chief's queue runner; the workers' `worker_ops`
  (their `UPDATE_OPS` and in-place statistics) run in the workers' train
  ops, and `sync`'s `variable_averages` after the step, both on skipped
  steps too: a NaN batch would leave NaN statistics and shadows in every
  checkpoint.
  """
  unprotected = []
  if worker_ops:
    names = [rollback.as_op(op).name for op in worker_ops]
    unprotected.append("the workers' %d update ops (%s)" % (
        len(names), ", ".join(names[:3]) + (", ..." if len(names) > 3
                                            else "")))
  averages = sync is not None and sync._variable_averages is not None  # pylint: disable=protected-access
  if averages:
    unprotected.append("its variable_averages")
  if unprotected:
    raise ValueError(
        "SkipNonFiniteOptimizer inside SyncReplicasOptimizer: its step runs "
        "in the chief's queue runner, and %s write outside it, on skipped "
        "steps too (a NaN batch leaves NaN in every checkpoint). Put the "
        "wrapper outside instead, where it protects them: `%s`, then "
        "`train_op = opt.protect(train_op)` for update ops grouped into the "
        "train op; where a SyncReplicasOptimizer itself is required "
        "(`slim.learning.train(sync_optimizer=...)`), pass "
        "`opt.wrapped_optimizer`" % (" and ".join(unprotected), ADVICE))


def _snapshot(variable):
  """`variable`'s value when this op runs, a copy (a ref variable's
  plain read could alias its buffer and change with it)."""
  return tf.raw_ops.Snapshot(input=shadows.read_written(variable))


def _after_deps(grad):
  """`grad` through an identity under the current control dependencies."""
  if grad is None:
    return None
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(tf.identity(grad.values), grad.indices,
                            grad.dense_shape)
  return tf.identity(grad)


def _worker_view(grads_and_vars, updates):
  """A `guard.GuardResult` of the worker's own gradients and statistics.

  `applied` is False if one of them is not finite (the aggregate then is
  not either, and the chief skips); `_outside` adds the chief's decision.
  `counters` is None: they are the chief's, whose step a worker's fetch
  must never run.
  """
  checked = [(g, v) for g, v in grads_and_vars if g is not None]
  written = rollback.written_variables(updates)
  with tf1.name_scope("sync_worker_view"):
    with tf1.control_dependencies(updates):
      values = [shadows.read_written(v) for v in written]
    any_bad = tf.logical_or(nonfinite.any_nonfinite([g for g, _ in checked]),
                            nonfinite.any_written_nonfinite(values))
    applied = tf.logical_not(any_bad, name="worker_finite")
  return guard.GuardResult(
      train_op=None, applied=applied,
      nonfinite_flags=nonfinite.nonfinite_flags([g for g, _ in checked]),
      variable_names=[v.op.name for _, v in checked], counters=None,
      update_flags=tf.stack([nonfinite.is_nonfinite(v) for v in values])
      if values else tf.zeros([0], tf.bool),
      update_variable_names=[v.op.name for v in written])


class _ChiefStep(object):
  """What `SyncReplicasOptimizer` calls to apply the aggregate: the wrapper's
  guarded step over the wrapped optimizer, and the averages inside it."""

  def __init__(self, build_step, protect, inner, averages, to_average):
    self._build_step = build_step
    self._protect = protect
    self._inner = inner
    self._averages = averages
    self._to_average = to_average

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    grads_and_vars = tuple(grads_and_vars)
    inner = self._inner
    result = self._build_step(
        grads_and_vars, global_step,
        lambda checked: inner.apply_gradients(checked, name=name),
        [(inner, grads_and_vars)])
    if self._averages is None:
      return result.train_op
    with tf1.control_dependencies([result.train_op]):
      averaged = self._averages.apply(self._to_average)
    return tf.group(result.train_op,
                    self._protect(averaged, name="protect_averages"))
