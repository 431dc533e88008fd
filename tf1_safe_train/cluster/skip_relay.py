"""Every worker's skip records reach the chief's `skips.jsonl` through the
cluster: `SkipRelay`, a bounded string queue on ps 0.

A non-chief worker appends each skip record (`forensics.ForensicsHook`) to
its own `--train_dir` as on one machine, then sends it, as JSON, into the
queue; the chief drains the queue after each of its steps and once more
after every worker has stopped (`EndOfRunHook` runs first), and appends
each record to `skips-worker<i>.jsonl` in its own `--train_dir`, unless an
equal record is already there (workers sharing the chief's directory wrote
it themselves). The chief's run summary, which counts every worker's
records in its directory (`verdict_counts.totals`), then carries them.

A send never blocks the worker's step: it enqueues only while the queue
holds fewer than `CAPACITY - num_workers` records (each worker has at most
one send in flight, so the queue never fills), else the record is dropped
from the relay (still in the worker's own log) with a warning. The queue
lives on ps 0, so a restarted chief drains what was sent before.
"""

import json

from absl import logging
import tensorflow as tf

from tf1_safe_train.core import skip_log

tf1 = tf.compat.v1

CAPACITY = 1000  # Records waiting for the chief (a few KB each).
_SHARED_NAME = "skip_records_relay"
_SEND_TIMEOUT_MS = 10000  # Only a ps that stopped answering waits so long.


class SkipRelay(object):
  """The relay's queue and ops (built before the graph is finalized)."""

  def __init__(self, num_workers, capacity=CAPACITY):
    if capacity <= num_workers:
      raise ValueError("SkipRelay: capacity %d must exceed num_workers %d" %
                       (capacity, num_workers))
    with tf1.name_scope("skip_relay"), tf1.device("/job:ps/task:0"):
      queue = tf1.FIFOQueue(capacity, [tf.string], shapes=[[]],
                            shared_name=_SHARED_NAME, name="records")
      self._record = tf1.placeholder(tf.string, [], name="record")
      # Enqueues only below the margin: never blocks (see the module doc).
      self._send = tf.cond(queue.size() < capacity - num_workers,
                           lambda: _true_after(queue.enqueue(self._record)),
                           lambda: tf.constant(False))
      self.size = queue.size()
      self._count = tf1.placeholder(tf.int32, [], name="count")
      self._drain = queue.dequeue_many(self._count)
    self.dropped = 0
    self.drained = 0

  def send(self, session, record):
    """Sends `record` (a dict) to the chief; False if it was dropped."""
    why = "its queue is full"
    try:
      sent = bool(session.run(
          self._send, {self._record: skip_log.encode(record)},
          options=tf1.RunOptions(timeout_in_ms=_SEND_TIMEOUT_MS)))
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError) as e:
      sent, why = False, type(e).__name__
    if not sent:
      self.dropped += 1
      logging.warning("step %d: skip record not sent to the chief (%s); "
                      "it is in this worker's own skips log", record["step"],
                      why)
    return sent

  def drain(self, session, train_dir, waiting):
    """Appends the `waiting` records the queue holds (the chief is its one
    reader: they are there) to `train_dir`'s logs; returns how many."""
    if waiting <= 0:
      return 0
    appended = 0
    for raw in session.run(self._drain, {self._count: int(waiting)}):
      record = json.loads(raw.decode("utf-8"))
      log_path = skip_log.path(train_dir, int(record["worker"]))
      if record not in skip_log.read_lines(log_path, lambda r: None):
        skip_log.append(log_path, record)
        appended += 1
    self.drained += appended
    return appended


def _true_after(op):
  with tf.control_dependencies([op]):
    return tf.constant(True)


class DrainHook(tf1.train.SessionRunHook):
  """The chief's: drains the relay after each step (the queue's size is
  fetched with the step) and at the end, after every worker stopped."""

  def __init__(self, relay, train_dir):
    self._relay = relay
    self._train_dir = train_dir

  def before_run(self, run_context):
    return tf1.train.SessionRunArgs(self._relay.size)

  def after_run(self, run_context, run_values):
    self._relay.drain(run_context.session, self._train_dir,
                      run_values.results)

  def end(self, session):
    # EndOfRunHook's end ran first: every worker's last record was sent.
    try:
      self._relay.drain(session, self._train_dir,
                        session.run(self._relay.size))
    except (tf.errors.UnavailableError, tf.errors.CancelledError,
            tf.errors.AbortedError) as e:  # A lost ps: the run ends anyway.
      logging.warning("the workers' last skip records were not drained "
                      "(%s)", type(e).__name__)
