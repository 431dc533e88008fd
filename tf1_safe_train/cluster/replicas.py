"""Between-graph replication: servers, sessions and the end of a run.

A cluster task runs its own gRPC server; workers build the trainer's graph
with state on the parameter servers, and a small protocol through shared
queues on the ps lets every process end by itself when the run is over (a ps
serves until every worker reported done; the chief waits for the others
before its final checkpoint).
"""

import collections
import os
import time

from absl import logging
import tensorflow as tf

from tf1_safe_train.cluster import spec as cluster_lib
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1


# How often a non-chief worker checks whether the chief has initialised the
# variables; TF's session creators poll every 30 s, which would dominate the
# start-up of a cluster.
_RECOVERY_WAIT_SECS = 1
# How long a closing session waits for its queue-runner threads. With
# --sync_replicas the chief's thread may wait in the gradient accumulators for
# replicas that have already stopped (TF's default would add 120 s).
_STOP_GRACE_SECS = 2
# How long the chief waits at the end for the other workers to stop, so that
# its final checkpoint and run summary come after their last steps.
END_WAIT_SECS = 60
# How long a worker told to stop (SIGTERM, Ctrl-C) may take to end its run
# before it exits without its final checkpoint: a step blocked on a replica
# that is gone would otherwise keep it for ever.
SIGNAL_GRACE_SECS = 60
# Shared queues (on the ps) of the end-of-run protocol: worker indices.
_STOPPED_QUEUE = "tf1_safe_train_stopped_workers"
_DONE_QUEUE = "tf1_safe_train_done_workers_ps%d"


def worker_device(cluster):
  """This worker's device prefix, e.g. '/job:worker/task:1'."""
  return "/job:worker/task:%d" % cluster.task_index


def cluster_tower_config(params, cluster):
  """Towers on this worker's devices, variables on the ps (round robin)."""
  setter = tf1.train.replica_device_setter(
      worker_device=worker_device(cluster), cluster=cluster.cluster_spec())
  return towers.TowerConfig(params.num_towers, params.device,
                            variables_device=setter)


def cluster_session_config(tower_config, cluster):
  """Session config of a worker: sees the ps tasks and itself only."""
  proto = towers.session_config(tower_config)
  proto.device_filters.extend(["/job:ps", worker_device(cluster)])
  return proto


def start_server(cluster, params):
  """Starts this task's gRPC server; a CPU worker gets one device per tower.

  Raises:
    cluster.ClusterError: if the server cannot start (e.g. port in use).
  """
  config = tf1.ConfigProto()
  if cluster.job_name == cluster_lib.WORKER and params.device == "cpu":
    config.device_count["CPU"] = params.num_towers
  try:
    return tf1.train.Server(cluster.cluster_spec(), job_name=cluster.job_name,
                            task_index=cluster.task_index, config=config)
  except tf.errors.OpError as e:
    raise cluster_lib.ClusterError(
        "cannot start the gRPC server of %s at %s (is the port in use?): %s" %
        (cluster.task_name, cluster.address, e.message)) from None


def _done_queue(ps_index):
  with tf1.device("/job:ps/task:%d" % ps_index):
    return tf1.FIFOQueue(-1, [tf.int32], shapes=[[]],
                         shared_name=_DONE_QUEUE % ps_index,
                         name="done_workers_ps%d" % ps_index)


def serve_parameter_server(cluster, params):
  """Serves ps task `cluster.task_index` until every worker has finished.

  Each worker, once its run is over, puts its index into a queue on every
  ps; the ps returns when it has seen every worker index (a restarted worker
  counts once), so no ps is left running after the run.

  Args:
    cluster: a `cluster.ClusterConfig` whose job is 'ps'.
    params: `params.TrainParams`.
  """
  if cluster.job_name != cluster_lib.PS:
    raise ValueError("serve_parameter_server runs a ps task, not %s" %
                     cluster.task_name)
  server = start_server(cluster, params)
  logging.info("%s serving at %s until %d worker(s) finish", cluster.task_name,
               cluster.address, cluster.num_workers)
  with tf.Graph().as_default():
    dequeue = _done_queue(cluster.task_index).dequeue()
    config = tf1.ConfigProto(
        device_filters=["/job:ps/task:%d" % cluster.task_index])
    with tf1.Session(server.target, config=config) as session:
      finished = set()
      while len(finished) < cluster.num_workers:
        finished.add(int(session.run(dequeue)))
        logging.info("%s: workers finished: %s of %d", cluster.task_name,
                     sorted(finished), cluster.num_workers)
  logging.info("%s: every worker finished; exiting", cluster.task_name)


EndOfRunOps = collections.namedtuple("EndOfRunOps", [
    "close_tokens", "stopped_enqueue", "stopped_dequeue", "done_enqueue",
    "final_reads"])


def end_of_run_ops(cluster, variables, close_tokens=None):
  """Builds the ops of the end-of-run protocol (see `EndOfRunHook`).

  Args:
    cluster: this worker's `cluster.ClusterConfig`.
    variables: the step's state variables (`train_step.Step.variables`).
    close_tokens: with sync replicas, the op closing the token queue.
  """
  index = tf.constant(cluster.task_index, tf.int32)
  with tf1.name_scope("end_of_run"):
    with tf1.device("/job:ps/task:0"):
      stopped = tf1.FIFOQueue(-1, [tf.int32], shapes=[[]],
                              shared_name=_STOPPED_QUEUE,
                              name="stopped_workers")
    final_reads = {
        "global_step": variables["global_step"].read_value(),
        "counters": counters_lib.SkipCounters(
            *[c.read_value() for c in variables["counters"]]),
        "nonfinite_steps_by_tower":
            variables["nonfinite_steps_by_tower"].read_value(),
        "max_consecutive_skips_seen":
            variables["max_consecutive_skips_seen"].read_value(),
    }
    return EndOfRunOps(
        close_tokens=close_tokens,
        stopped_enqueue=stopped.enqueue(index),
        stopped_dequeue=stopped.dequeue(),
        done_enqueue=tf.group(*[_done_queue(i).enqueue(index)
                                for i in range(cluster.num_ps)]),
        final_reads=final_reads)


class EndOfRunHook(tf1.train.SessionRunHook):
  """Ends a worker's run without leaving anybody waiting.

  When a worker stops because the run is over (max_steps or give-up, which
  every worker sees in the shared variables; not on a signal, which may stop
  one worker only), it closes the sync token queue, so no replica waits for
  a token that will never come. A non-chief worker then reports that it
  stopped; the chief waits (at most `wait_secs`) for those reports and reads
  the final counters, so that its final checkpoint (saved by a later hook's
  `end`) and run summary come after every worker's last step.
  """

  def __init__(self, cluster, ops, stopped_by_signal, wait_secs):
    self._cluster = cluster
    self._ops = ops
    self._stopped_by_signal = stopped_by_signal
    self._wait_secs = wait_secs
    self.final = None

  def end(self, session):
    if self._ops.close_tokens is not None and not self._stopped_by_signal():
      try:
        session.run(self._ops.close_tokens)
      except tf.errors.CancelledError:
        pass  # Another worker closed it first.
    if not self._cluster.is_chief:
      session.run(self._ops.stopped_enqueue)
      return
    if not self._stopped_by_signal():
      self._wait_for_workers(session)
    self.final = session.run(self._ops.final_reads)

  def _wait_for_workers(self, session):
    waiting = set(range(1, self._cluster.num_workers))
    deadline = time.monotonic() + self._wait_secs
    while waiting:
      remaining_ms = int((deadline - time.monotonic()) * 1000)
      try:
        if remaining_ms <= 0:
          raise tf.errors.DeadlineExceededError(None, None, "")
        waiting.discard(int(session.run(
            self._ops.stopped_dequeue,
            options=tf1.RunOptions(timeout_in_ms=remaining_ms))))
      except tf.errors.DeadlineExceededError:
        logging.warning("worker(s) %s did not stop within %ds; saving the "
                        "final checkpoint without waiting for them",
                        sorted(waiting), self._wait_secs)
        return


class _ClusterSessionCreator(tf1.train.SessionCreator):
  """TF's Chief/WorkerSessionCreator, polling every _RECOVERY_WAIT_SECS.

  The chief initialises the variables or restores the last checkpoint; a
  non-chief worker waits (at most `max_wait_secs`) until the chief has.
  """

  def __init__(self, scaffold, master, config, is_chief, checkpoint_dir,
               max_wait_secs, task_name):
    self._task_name = task_name
    self._scaffold = scaffold
    self._master = master
    self._config = config
    self._is_chief = is_chief
    self._checkpoint_dir = checkpoint_dir
    self._max_wait_secs = max_wait_secs

  def create_session(self):
    session = self._create_session()
    # Tells when a (restarted) worker took part: its first step follows.
    step = tf1.train.get_global_step()
    if step is not None:
      logging.info("%s joined the run at global_step %d", self._task_name,
                   session.run(step))
    return session

  def _create_session(self):
    scaffold = self._scaffold
    scaffold.finalize()
    manager = tf1.train.SessionManager(
        local_init_op=scaffold.local_init_op,
        ready_op=scaffold.ready_op,
        ready_for_local_init_op=scaffold.ready_for_local_init_op,
        graph=tf1.get_default_graph(),
        recovery_wait_secs=_RECOVERY_WAIT_SECS,
        local_init_feed_dict=scaffold.local_init_feed_dict)
    if self._is_chief and self._ps_holds_model(scaffold):
      # A restarted chief: the parameter servers kept the model the other
      # workers go on training. Restoring the (older) checkpoint over it
      # would roll the shared global_step back and discard their steps.
      return manager.wait_for_session(self._master, config=self._config,
                                      max_wait_secs=self._max_wait_secs)
    if self._is_chief:
      return manager.prepare_session(
          self._master, saver=scaffold.saver,
          checkpoint_dir=self._checkpoint_dir, config=self._config,
          init_op=scaffold.init_op, init_feed_dict=scaffold.init_feed_dict,
          init_fn=scaffold.init_fn)
    return manager.wait_for_session(self._master, config=self._config,
                                    max_wait_secs=self._max_wait_secs)

  def _ps_holds_model(self, scaffold):
    """Whether every variable on the ps is initialised (a live run); logs."""
    with tf1.Session(self._master, config=self._config) as session:
      missing = session.run(scaffold.ready_for_local_init_op)
      global_step = tf1.train.get_global_step()
      step = (session.run(global_step)
              if not missing.size and global_step is not None else -1)
    total = len(tf1.global_variables())
    checkpoint = tf1.train.latest_checkpoint(self._checkpoint_dir)
    if not missing.size:
      logging.warning(
          "the parameter servers already hold the model at global_step %d (a "
          "running cluster): continuing from it, not from %s", step,
          os.path.basename(checkpoint) if checkpoint else "a new model")
      return True
    if missing.size < total:
      logging.warning(
          "the parameter servers hold %d of %d variables initialised (a ps "
          "restarted?): %s every variable, discarding their values",
          total - missing.size, total,
          "restoring %s over" % os.path.basename(checkpoint) if checkpoint
          else "initialising")
    return False


def report_done(server, ops, config, timeout_secs):
  """Tells every ps that this worker has finished (serve_parameter_server)."""
  try:
    with tf1.Session(server.target, config=config) as session:
      session.run(ops.done_enqueue, options=tf1.RunOptions(
          timeout_in_ms=int(timeout_secs * 1000)))
  except tf.errors.OpError as e:
    logging.warning("could not tell the parameter servers that this worker "
                    "finished (%s: %s)", type(e).__name__, e.message)


def cluster_session(params, cluster, master, config, scaffold, hooks):
  """The MonitoredSession of a worker, running `hooks` in their order."""
  creator = _ClusterSessionCreator(
      scaffold, master, config, cluster.is_chief, params.train_dir,
      max_wait_secs=params.startup_timeout_secs, task_name=cluster.task_name)
  return tf1.train.MonitoredSession(session_creator=creator, hooks=hooks,
                                    stop_grace_period_secs=_STOP_GRACE_SECS)
