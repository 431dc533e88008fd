r"""`//:local_cluster`: a whole training cluster on this machine, for drills.

  ./bazelw run //:local_cluster -- --num_ps=1 --num_workers=2 -- \
      --train_dir=/tmp/cluster --max_steps=300 --sync_replicas \
      --inject_nonfinite=nan@100-110:0/1

starts `--num_ps` ps tasks and `--num_workers` workers of `//:train` on free
127.0.0.1 ports, each with its own `TF_CONFIG`, prints their output with each
line prefixed by its task (`[worker 1] ...`), and exits with the chief's exit
code. It stops every process it started: when the chief has finished (after
a grace period for the others), when a task fails before the chief has
finished (exit 1, one line naming the task), and on Ctrl-C or SIGTERM
(workers first, so that the chief saves its checkpoint; exit 128 + signal).
Its tasks get SIGTERM if the launcher dies, even by SIGKILL, and run in a
network namespace of their own where the machine allows it (TensorFlow's
gRPC servers listen on every interface, unauthenticated).
"""

import os
import signal
import sys
import tempfile
import time

from absl import app
from absl import flags

from tf1_safe_train import cli
from tf1_safe_train.cluster import local_cluster_lib
from tf1_safe_train.cluster import private_network
from tf1_safe_train.trainer.run import train_dir as train_dir_lib

flags.DEFINE_integer("num_ps", 1, "Number of parameter servers.")
flags.DEFINE_integer("num_workers", 2,
                     "Number of workers (worker 0 is the chief).")
flags.DEFINE_boolean("private_network", True,
                     "Run the tasks in a network namespace of their own, so "
                     "that their gRPC ports (open to every interface, "
                     "unauthenticated) are reachable from nowhere else; "
                     "false, or where the machine does not allow it: every "
                     "interface of this machine.")
flags.DEFINE_float("stop_grace_secs", 15.0,
                   "How long tasks get to stop by themselves (after the "
                   "chief has finished, or after SIGTERM) before SIGKILL.")

FLAGS = flags.FLAGS
_PROGRAM = local_cluster_lib.PROGRAM


def train_command():
  """The command line that runs `//:train`.

  Under Bazel the `train` binary sits next to this file in the runfiles tree
  (it is a data dependency); otherwise the module runs with this Python.
  """
  sibling = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train")
  if os.path.isfile(sibling) and os.access(sibling, os.X_OK):
    return [sibling]
  return [sys.executable, "-m", "tf1_safe_train.train"]


def with_train_dir(train_args):
  """(`train_args`, None), or with a fresh --train_dir and its path if they
  give none: every task must name the same one, so the launcher chooses it.
  """
  if any(arg.split("=", 1)[0] in ("--train_dir", "-train_dir")
         for arg in train_args):
    return train_args, None
  train_dir = train_dir_lib.fresh()
  return list(train_args) + ["--train_dir=" + train_dir], train_dir


def noise_log():
  """Where the tasks' TensorFlow cleanup warnings go (`task_output`)."""
  return os.path.join(tempfile.gettempdir(), "local_cluster-%s-%d.log" % (
      time.strftime("%Y%m%d-%H%M%S"), os.getpid()))


def main(argv):
  train_args, fresh = with_train_dir(argv[1:])
  try:
    local_cluster_lib.check_train_args(train_args)
    launcher = local_cluster_lib.LocalCluster(
        FLAGS.num_ps, FLAGS.num_workers, lambda unused_task: train_command(),
        train_args, stop_grace_secs=FLAGS.stop_grace_secs,
        noise_log=noise_log())
  except ValueError as e:
    cli.fail(_PROGRAM, e)
  if fresh:
    launcher.message("--train_dir=%s (a fresh directory; pass --train_dir "
                     "after -- to choose one, the same one to resume)" %
                     fresh)
  if FLAGS.private_network:
    why_not = private_network.isolate()
    if why_not is not None:
      launcher.message(
          "cannot give the cluster a private network namespace (%s): its "
          "gRPC ports listen on every interface of this machine, "
          "unauthenticated; use it on a trusted network only" % why_not)
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda s, unused_frame: launcher.request_stop(s))
  code = launcher.run()
  if code < 0:  # The chief was killed by a signal.
    code = 128 - code
  sys.exit(code)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
