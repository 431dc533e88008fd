"""A loopback cluster for tests: the ps a thread, the workers forked binaries.

A cluster of //:local_cluster costs a TensorFlow import per task (about 4
CPU s each). Here the ps is a thread of the test process (which imported
TensorFlow already; `replicas.serve_parameter_server`, as a ps task runs
it), and worker i is a //:train run to its end in a child forked from a
`forked_python` server of its own (one per worker index, started on first
use, kept for the test process's next clusters): same argv, TF_CONFIG and
environment as a task of the launcher, so its flags, exit code, output and
files are the binary's (tests/binaries.py says what a forked run does not
prove). The launcher itself is proven by the tests that run it
(distributed_test, cluster_ends_test, cluster_in_process_test).
"""

import atexit
import collections
import os
import subprocess
import threading

import binaries
import forked_python
from tf1_safe_train.cluster import local_cluster_lib
from tf1_safe_train.cluster import replicas
from tf1_safe_train.trainer import params as params_lib

# What a run gives back: each worker's `subprocess.CompletedProcess` (or the
# exception its run raised, e.g. `subprocess.TimeoutExpired`), by index, and
# whether the ps thread ended (it ends once every worker reported done).
Result = collections.namedtuple("Result", ["workers", "ps_ended"])

_SERVERS = []  # forked_python servers, worker i's at index i.


def _server(index):
  while len(_SERVERS) <= index:
    if not _SERVERS:
      atexit.register(_close_servers)
    _SERVERS.append(forked_python.Server(binaries.env()))
  return _SERVERS[index]


def _close_servers():
  while _SERVERS:
    _SERVERS.pop().close()


def run(train_flags, num_workers=2, timeout=240):
  """Runs 1 ps (a thread) + `num_workers` workers of //:train to the end.

  Args:
    train_flags: the workers' flags (no cluster flag: TF_CONFIG says).
    num_workers: how many workers.
    timeout: seconds each worker may take before it is killed.

  Returns:
    A `Result`.
  """
  cluster = local_cluster_lib.make_cluster(num_ps=1, num_workers=num_workers)
  ps = threading.Thread(
      target=replicas.serve_parameter_server,
      args=(cluster.for_task("ps", 0), params_lib.TrainParams(device="cpu")),
      daemon=True)
  ps.start()
  workers = [None] * num_workers

  def work(index):
    environ = binaries.env(
        tf_config=cluster.for_task("worker", index).to_tf_config())
    try:
      workers[index] = _server(index).run_module(
          "tf1_safe_train.train", list(train_flags), environ, os.getcwd(),
          timeout)
    except (subprocess.TimeoutExpired, RuntimeError) as e:
      workers[index] = e

  for index in range(num_workers):  # Servers start one by one, not racing.
    _server(index)
  threads = [threading.Thread(target=work, args=(i,))
             for i in range(num_workers)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  ps.join(60)
  return Result(workers=workers, ps_ended=not ps.is_alive())
