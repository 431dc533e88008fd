"""Worker quarantine (`--skip_unit=worker --quarantine_after=K`): a worker
that keeps failing without reproducing is left out of every later step.

Each left-out push of this worker whose replay is finite (verdict "suspect
device", `forensics.ForensicsHook`) adds one to its count on the ps
(`suspect_faults_by_worker`, checkpointed); at K it claims a place in
`quarantined_workers` (on the ps too, so the floor holds across workers
deciding at once) unless fewer than `min_healthy` workers would be left,
and from then on pushes health-0 zeros without computing (`IdlePush`):
`replicas_to_aggregate` stays N, every step still gets one push of it, and
the chief averages the healthy ones (N - 1 batches a step). The chief
(worker 0) is never quarantined: its hooks save the run's checkpoints.

The decision is durable before it is announced:
`<train_dir>/quarantine_worker_<i>.json`, written atomically and fsynced
before the line, and read by a restart, which keeps the worker out until
`--clear_quarantine`.
"""

import json
import os
import time

from absl import logging

import tensorflow as tf

from tf1_safe_train.core import criteria
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.run import train_dir as train_dir_lib

tf1 = tf.compat.v1

FAULTS = "suspect_faults_by_worker"
QUARANTINED = "quarantined_workers"


def record_path(train_dir, worker):
  """Where worker `worker`'s decision is recorded."""
  return os.path.join(train_dir, "quarantine_worker_%d.json" % worker)


def _recorded(path, clear):
  """Whether `path` records a quarantine (False if `clear`: removed).

  Raises:
    train_dir_lib.TrainDirError: it is no file, or not a record of ours.
  """
  problem = skip_log.file_problem(path)
  if problem:
    raise train_dir_lib.TrainDirError(
        "%s %s: remove it (a run writes a file there)" % (path, problem))
  if clear:
    if os.path.exists(path):
      os.remove(path)
    return False
  try:
    with open(path) as f:
      faults = json.load(f).get("faults")
  except FileNotFoundError:
    return False
  except (OSError, ValueError, AttributeError) as e:
    faults = e
  if not (isinstance(faults, int) and not isinstance(faults, bool)):
    raise train_dir_lib.TrainDirError(
        "%s is not a worker quarantine record (%s); --clear_quarantine "
        "starts over" % (path, faults))
  return True


def _record(path, worker, faults):
  """Writes the decision atomically; durable when it returns."""
  with open(path + ".tmp", "w") as f:
    json.dump({"worker": worker, "faults": int(faults)}, f, sort_keys=True)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)
  directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
  try:
    os.fsync(directory)  # The rename itself.
  finally:
    os.close(directory)


class WorkerQuarantine(object):
  """This worker's quarantine: its count, the claim, the record.

  The interface `forensics.ForensicsHook` calls (as a tower quarantine's):
  `wants_replay(tower)`, `on_suspect(run_context, tower)`. `quarantined`
  says whether this worker now pushes idle (`IdlePush`).
  """

  def __init__(self, params, num_workers, worker_index, min_healthy, clear):
    self._after = params.quarantine_after
    self._num_workers = num_workers
    self._index = worker_index
    self._min_healthy = min_healthy
    self._clear = clear
    self._path = record_path(params.train_dir, worker_index)
    self.quarantined = _recorded(self._path, clear)
    self._forced = 0
    self._faults = self._count = self._claim = self._release = None
    self._reset = None
    self._told_chief = False
    self.variables = []
    self.restart = False  # (A tower quarantine's rebuild: none here.)
    self.final = None  # The quarantined workers at the session's end.

  def build(self, variables_device):
    """The counts on the ps and their ops (before the graph is final)."""
    n = self._num_workers
    mine = tf.one_hot(self._index, n, dtype=tf.int64)
    state = [tf1.GraphKeys.GLOBAL_VARIABLES, criteria.OPTIONAL_STATE]
    with tf1.device(variables_device):
      faults = tf1.Variable(tf.zeros([n], tf.int64), trainable=False,
                            name=FAULTS, collections=state)
      quarantined = tf1.Variable(tf.zeros([n], tf.int64), trainable=False,
                                 name=QUARANTINED, collections=state)
      self._count = tf1.assign_add(faults, mine, use_locking=True)
      # Each worker writes its own element only: two workers deciding at
      # once never undo each other's claim (both may see the floor broken
      # and give theirs back: never below it).
      self._claim, self._release, zero = [
          tf1.scatter_update(v, [self._index], tf.constant([x], tf.int64),
                             use_locking=True)
          for v, x in ((quarantined, 1), (quarantined, 0), (faults, 0))]
      self._reset = tf.group(zero, self._release)
    self.variables = [faults, quarantined]

  def hook(self):
    """Clears this worker's counts (--clear_quarantine), or claims its
    place again (a restart of a recorded quarantine), after the restore."""
    return _StartHook(self)

  def _end(self, session):
    try:
      self.final = [i for i, q in enumerate(session.run(self.variables[1]))
                    if q]
    except tf.errors.OpError:  # The ps gone: the summary goes without.
      pass

  def _start(self, session):
    if self._clear:
      session.run(self._reset)
    elif self.quarantined:
      self._decide(session, faults=None)

  def wants_replay(self, tower):
    """Whether a fault past --max_explained_skips gets a replay (at most K
    in a process, as a tower's)."""
    del tower  # A worker is quarantined whole.
    if self.quarantined or self._forced >= self._after:
      return False
    self._forced += 1
    return True

  def on_suspect(self, run_context, tower):
    """Counts a left-out push that did not reproduce; at K, quarantines
    this worker (within the floor)."""
    del tower
    counts = run_context.session.run(self._count)
    faults = int(counts[self._index])
    if faults < self._after or self.quarantined:
      return
    if self._index == 0:
      if not self._told_chief:
        logging.warning(
            "worker 0: %d faults that did not reproduce, but not "
            "quarantined: the chief runs the cluster's decisions and saves",
            faults)
        self._told_chief = True
      return
    self._decide(run_context.session, faults)

  def _decide(self, session, faults):
    """Claims a place (or gives it back below the floor); records, then
    tells. `faults` None: a restart of a recorded decision."""
    claimed = session.run(self._claim)
    left = self._num_workers - int(claimed.sum())
    if left < self._min_healthy:
      session.run(self._release)
      logging.warning(
          "worker %d: faults that did not reproduce, but not quarantined: "
          "%d workers would be left (--min_healthy_workers=%d)",
          self._index, left, self._min_healthy)
      self.quarantined = False
      return
    if faults is None:
      logging.warning(
          "worker %d quarantined (%s, kept; --clear_quarantine starts "
          "over): it pushes no gradients", self._index,
          os.path.basename(self._path))
      return
    # Durable before announced: a kill right after the line keeps it.
    _record(self._path, self._index, faults)
    logging.warning(
        "worker %d quarantined: %d faults that did not reproduce on replay "
        "(--quarantine_after=%d); left out of every later step (%d of %d "
        "workers train on)", self._index, faults, self._after, left,
        self._num_workers)
    self.quarantined = True


class _StartHook(tf1.train.SessionRunHook):

  def __init__(self, quarantine):
    self._quarantine = quarantine

  def after_create_session(self, session, coord):
    del coord
    self._quarantine._start(session)  # pylint: disable=protected-access

  def end(self, session):
    self._quarantine._end(session)  # pylint: disable=protected-access


class IdlePush(object):
  """What a quarantined worker runs instead of its step: a push of zeros
  into every accumulator (its health count 0 pushes, 0 healthy: neither
  left out nor degraded) and the sync token, as TF's worker op does; but
  one push per global step only.

  A worker that computes nothing is faster than the others, and TF's
  tokens let a worker ahead take a slower one's turn: an idle worker would
  fill a step's aggregate with its zeros (no healthy push left: the step
  skipped). So after a push for step t it takes its next token only once
  step t is applied (global_step > t), and the others take the rest.
  """

  # How often a waiting idle worker reads global_step (seconds).
  POLL_SECS = 0.005

  def __init__(self, sync_optimizer):
    """Builds the ops from the optimizer's accumulators (after its
    `apply_gradients`).

    Raises:
      ValueError: a sparse gradient's accumulator (not supported).
    """
    # pylint: disable=protected-access
    optimizer = sync_optimizer
    pushes = []
    for accumulator, device in optimizer._accumulator_list:
      if not isinstance(accumulator, tf1.ConditionalAccumulator):
        raise ValueError("--quarantine_after with --skip_unit=worker: a "
                         "sparse gradient (%s) is not supported" %
                         accumulator.name)
      with tf1.device(device):
        pushes.append(accumulator.apply_grad(
            tf.zeros(accumulator._shape, accumulator.dtype),
            local_step=optimizer._local_step))
    with tf1.control_dependencies(pushes):
      # The step pushed for.
      self.push = tf.identity(optimizer._local_step, name="idle_push")
    with tf1.device(optimizer._global_step.device):
      self.global_step = tf.identity(optimizer._global_step)
      token = optimizer._sync_token_queue.dequeue()
      self.op = tf1.assign(optimizer._local_step, token, name="idle_token")

  def run(self, session, max_steps):
    """Pushes once (raw: no hook computes the step), waits for that step's
    update, then takes a token; stops the session at `max_steps` or when
    the tokens are closed (the run's end)."""

    def push(step_context):
      run = step_context.session.run
      try:
        pushed = run(self.push)
        while run(self.global_step) <= pushed:
          if pushed >= max_steps:
            step_context.request_stop()
            return
          time.sleep(self.POLL_SECS)
        token = run(self.op)
      except (tf.errors.OutOfRangeError, tf.errors.CancelledError):
        step_context.request_stop()
        return
      if token >= max_steps:
        step_context.request_stop()

    session.run_step_fn(push)
