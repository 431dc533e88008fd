"""Rollback in a sync cluster: the chief restores between an update and its tokens.

`SyncReplicasOptimizer`'s chief queue runner applies an aggregate and then
enqueues the next step's tokens, in one run; here it runs them in two, and
between them the rollback point (`checkpoint_rollback.RollbackHook
.sync_point`): no replica can read the weights for the next step, or push
gradients on them, until those tokens are there.

Why that point, and what it guarantees:
  - no update interleaves: the only writer of the model is this thread,
    and the replicas wait for its tokens (hooks run in a worker's own
    thread, at its own pace: not there);
  - gradients pushed on the weights before the restore are dropped: a
    rollback keeps `global_step` (history, `state_rules`), so the
    accumulators' step (one per aggregate taken) stays equal to it, and a
    gradient pushed with an older token's step is stale for them; the next
    tokens carry the current step, and every replica computes on the
    restored weights once it holds one;
  - the data window is skipped on every worker: each worker's input is
    already past the batches it fed since the checkpoint.
"""

import tensorflow as tf

tf1 = tf.compat.v1


class PointQueueRunner(tf1.train.QueueRunner):
  """The chief's aggregate step, with `point(session)` between its update
  and its tokens (TF's `QueueRunner` runs both as one enqueue); the
  update's run also fetches the decision's values, told after the tokens
  (`sync_replicas.ChiefDecisions`).

  Ends as TF's does: a closed or cancelled queue ends the thread, any other
  error stops the coordinator.
  """

  def __init__(self, runner, point, queue_closed_exception_types,
               decisions=None):
    """Args:
      runner: `SyncReplicasOptimizer.get_chief_queue_runner()`.
      point: function(session), run after each update, before its tokens.
      queue_closed_exception_types: as `tf1.train.QueueRunner`'s.
      decisions: a `sync_replicas.ChiefDecisions` (its `fetches`, its
        `tell`), or None.
    """
    sync_op, = runner.enqueue_ops
    if sync_op.type != "QueueEnqueueManyV2":
      raise ValueError("the chief's sync op is %s, not the token enqueue: "
                       "a rollback point needs SyncReplicasOptimizer "
                       "without variable averages" % sync_op.type)
    # The tokens (the global step after the update) run the update first.
    self._tokens = sync_op.inputs[1]
    with tf1.name_scope("sync_rollback"), tf1.device(sync_op.device):
      self._fed = tf1.placeholder(self._tokens.dtype, self._tokens.shape,
                                  name="tokens")
      enqueue = runner.queue.enqueue_many((self._fed,))
    super(PointQueueRunner, self).__init__(
        runner.queue, [enqueue],
        queue_closed_exception_types=queue_closed_exception_types)
    self._point = point
    self._decisions = decisions

  def _run(self, sess, enqueue_op, coord=None):
    decremented = False
    try:
      decisions = self._decisions
      update = sess.make_callable(
          [self._tokens, decisions.fetches if decisions else []])
      enqueue = sess.make_callable(enqueue_op, feed_list=[self._fed])
      while not (coord and coord.should_stop()):
        try:
          tokens, values = update()
          # A thread starts eager: the point's graph calls (a `Saver`'s
          # restore) need the session's graph.
          with sess.graph.as_default():
            self._point(sess)
          enqueue(tokens)
          if decisions:
            decisions.tell(values)
        except self._queue_closed_exception_types:  # pylint: disable=catching-non-exception
          with self._lock:
            self._runs_per_session[sess] -= 1
            decremented = True
            if self._runs_per_session[sess] == 0:
              try:
                sess.run(self._close_op)
              except Exception:  # pylint: disable=broad-except
                pass  # As TF's: the queue may be gone with the session.
            return
    except Exception as e:  # pylint: disable=broad-except
      if not coord:
        raise
      coord.request_stop(e)
    finally:
      if not decremented:
        with self._lock:
          self._runs_per_session[sess] -= 1
