"""The logic of `//:local_cluster`: a training cluster's tasks on this machine.

`LocalCluster` starts ps and worker tasks on free 127.0.0.1 ports, each with
its own `TF_CONFIG`, copies their output with each line prefixed by its task
(`[worker 1] ...`), and stops every process it started: when the chief has
finished (after a grace period for the others), when a task fails before the
chief has finished, and on `request_stop` (workers first, so that the chief
saves its checkpoint). Its tasks get SIGTERM if the launcher dies, even by
SIGKILL. The binary (local_cluster.py) holds the flags and `main`.
"""

import ctypes
import ctypes.util
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import launch_limit
from tf1_safe_train.cluster import spec as cluster_lib
from tf1_safe_train.cluster import task_output

PROGRAM = "local_cluster"
_POLL_SECS = 0.1
_PR_SET_PDEATHSIG = 1  # From <sys/prctl.h>.


def free_ports(count, host="127.0.0.1"):
  """Returns `count` distinct ports that were free on `host` a moment ago."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind((host, 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def make_cluster(num_ps, num_workers, host="127.0.0.1"):
  """A `ClusterConfig` (seen from worker 0) on free ports of `host`."""
  ports = free_ports(num_ps + num_workers, host)
  address = lambda port: "%s:%d" % (host, port)
  return cluster_lib.ClusterConfig(
      ps=[address(p) for p in ports[:num_ps]],
      worker=[address(p) for p in ports[num_ps:]],
      job_name=cluster_lib.WORKER, task_index=0)


def check_train_args(args):
  """Raises ValueError if `args` set a cluster flag (TF_CONFIG sets those)."""
  for arg in args:
    name = arg.lstrip("-").split("=", 1)[0]
    if arg.startswith("-") and name in cluster_flags.NAMES:
      raise ValueError("--%s is set by local_cluster (through TF_CONFIG); "
                       "do not pass it" % name)


class _Task(object):
  """One child process and the threads copying its output."""

  def __init__(self, config, command, env, out, err, lock, noise=None):
    self.name = config.task_name
    self.config = config
    self.asked_to_stop = False
    env = dict(env, TF_CONFIG=config.to_tf_config())
    # A new session: Ctrl-C in the terminal reaches the launcher only, which
    # stops the tasks in order (a second SIGINT would kill a trainer before
    # its final checkpoint).
    self.process = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_die_with_parent)
    self.threads = [
        threading.Thread(target=task_output.copy_lines,
                         args=(self.process.stdout, out, "[%s] " % self.name,
                               lock), daemon=True),
        threading.Thread(target=task_output.copy_lines,
                         args=(self.process.stderr, err, "[%s] " % self.name,
                               lock, noise), daemon=True),
    ]

  def start_output(self):
    for thread in self.threads:
      thread.start()

  def poll(self):
    return self.process.poll()

  def ask_to_stop(self, signum):
    """Sends `signum` (a stop request) once: True if sent now.

    A trainer takes a second signal as "stop at once, without the final
    checkpoint"; one stop request must never look like two.
    """
    if self.asked_to_stop or self.process.poll() is not None:
      return False
    self.asked_to_stop = True
    self.signal(signum)
    return True

  def signal(self, signum):
    if self.process.poll() is None:
      try:
        self.process.send_signal(signum)
      except ProcessLookupError:
        pass

  def join_output(self, timeout=5.0):
    for thread in self.threads:
      thread.join(timeout)


def _die_with_parent():
  """In the child (Linux): SIGTERM when the launcher dies, even by SIGKILL.

  Runs between fork and exec, so the launcher starts every task before it
  starts any thread (a `preexec_fn` is not safe once threads exist).
  """
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                       use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
  except (OSError, AttributeError):
    pass  # Not Linux: the launcher still stops its tasks unless SIGKILLed.


class LocalCluster(object):
  """Starts, watches and stops the tasks of a cluster on this machine."""

  def __init__(self, num_ps, num_workers, command_fn, args=(), env=None,
               out=None, err=None, stop_grace_secs=30.0, noise_log=None):
    """Describes the cluster; `run()` starts it.

    Args:
      num_ps: number of ps tasks (>= 1).
      num_workers: number of workers (>= 1).
      command_fn: callable(ClusterConfig) -> the command of that task
        (without `args`).
      args: arguments appended to every task's command.
      env: base environment (default: this process's); TF_CONFIG is set per
        task.
      out, err: where the tasks' stdout and stderr lines go.
      stop_grace_secs: how long tasks get to stop before SIGKILL.
      noise_log: a file for the tasks' `task_output.NOISE` lines, which
        then stay off `err` (one line at the end names the file); None:
        `err` gets them.
    """
    if num_ps < 1 or num_workers < 1:
      raise ValueError("a cluster needs at least one ps and one worker, got "
                       "--num_ps=%d --num_workers=%d" % (num_ps, num_workers))
    launch_limit.check(num_ps, num_workers)  # Before anything is opened.
    if not (math.isfinite(stop_grace_secs) and stop_grace_secs >= 0):
      # NaN would pass any comparison: "still running nans after...".
      raise ValueError("--stop_grace_secs=%g: must be a finite number >= 0" %
                       (stop_grace_secs,))
    self._num_ps = num_ps
    self._num_workers = num_workers
    self._command_fn = command_fn
    self._args = list(args)
    self._env = dict(os.environ if env is None else env)
    self._env.pop(cluster_lib.TF_CONFIG, None)
    self._out = out or sys.stdout
    self._err = err or sys.stderr
    self._stop_grace_secs = stop_grace_secs
    self._noise = task_output.NoiseLog(noise_log) if noise_log else None
    self._lock = threading.Lock()
    self._signal = None
    self.tasks = []

  def request_stop(self, signum):
    """Called from a signal handler: `run()` stops the cluster and returns."""
    self._signal = signum

  def run(self):
    """Runs the cluster; returns the launcher's exit code."""
    config = make_cluster(self._num_ps, self._num_workers)
    try:
      for job, count in ((cluster_lib.PS, self._num_ps),
                         (cluster_lib.WORKER, self._num_workers)):
        for i in range(count):
          task = config.for_task(job, i)
          self.tasks.append(_Task(task, self._command_fn(task) + self._args,
                                  self._env, self._out, self._err,
                                  self._lock, self._noise))
      for task in self.tasks:
        task.start_output()
      return self._watch()
    finally:
      self.stop()

  def _chief(self):
    return next(t for t in self.tasks if t.config.is_chief)

  def _watch(self):
    chief = self._chief()
    while True:
      if self._signal is not None:
        self._stop_all(self._signal)
        code = chief.poll()
        # The chief's own failure, if it had one; else "stopped by signal".
        return code if code and code > 0 else 128 + self._signal
      code = chief.poll()
      if code is not None:
        if code == 0:
          self._wait_for_others()
        return code
      for task in self.tasks:
        code = task.poll()
        if code is not None and code != 0 and task is not chief:
          self.message("%s exited with %s before the chief finished; "
                        "stopping the cluster" % (task.name, _describe(code)))
          return 1
      time.sleep(_POLL_SECS)

  def _wait_for_others(self):
    """After a clean chief: the others end by themselves, or are stopped."""
    deadline = time.monotonic() + self._stop_grace_secs
    while time.monotonic() < deadline:
      if all(t.poll() is not None for t in self.tasks):
        return
      time.sleep(_POLL_SECS)
    left = [t.name for t in self.tasks if t.poll() is None]
    self.message("still running %gs after the chief finished: %s; stopping "
                  "them" % (self._stop_grace_secs, ", ".join(left)))

  def _stop_all(self, signum=signal.SIGTERM):
    """Workers first (the chief saves), then the ps tasks.

    Each task is asked once; one already asked has had its grace period.
    """
    for job in (cluster_lib.WORKER, cluster_lib.PS):
      group = [t for t in self.tasks if t.config.job_name == job and
               t.ask_to_stop(signum)]
      self._wait(group, self._stop_grace_secs)

  def _wait(self, tasks, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        t.poll() is None for t in tasks):
      time.sleep(_POLL_SECS)

  def stop(self):
    """Stops whatever is still running: SIGTERM (once), grace, SIGKILL."""
    self._stop_all(signal.SIGTERM)
    for task in self.tasks:
      if task.poll() is None:
        task.signal(signal.SIGKILL)
      try:
        task.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
      task.join_output()
    if self._noise is not None and self._noise.count:
      self._noise.close()
      self.message("%d line(s) of TensorFlow's cleanup warnings (\"Local "
                   "rendezvous is aborting with status: ABORTED: Cleanup "
                   "...\") not shown: %s" % (self._noise.count,
                                              self._noise.path))

  def message(self, text):
    with self._lock:
      self._err.write("%s: %s\n" % (PROGRAM, text))
      self._err.flush()


def _describe(code):
  if code < 0:
    try:
      return "signal %s" % signal.Signals(-code).name
    except ValueError:
      return "signal %d" % -code
  return "exit code %d" % code
