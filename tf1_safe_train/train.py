r"""`//:train`: the multi-tower trainer. Flags are defined here and only here.

  ./bazelw run //:train -- --num_towers=2 --max_steps=600 \
      --inject_nonfinite=nan@100:1,inf@300:0 --train_dir=/tmp/run1

In a cluster (TF_CONFIG, or --ps_hosts/--worker_hosts/--job_name/
--task_index) the same binary runs one task: a ps serves until every worker
has finished; a worker trains (worker 0 is the chief).
"""

import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging

from tf1_safe_train import cli
from tf1_safe_train import console
from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import spec as cluster_lib
from tf1_safe_train.trainer.run import crash_report
from tf1_safe_train.trainer.run import disk_full
from tf1_safe_train.trainer.config import flag_groups
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.drills import injection_spec
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.config import preflight
from tf1_safe_train.trainer.run import train_dir as train_dir_lib

# Declared in params.TrainParams and cluster_flags; defined here, so that
# absl files them under this binary (--helpshort).
_SPECS = flag_specs.of_params(params_lib.TrainParams) + cluster_flags.FLAGS
for _spec in _SPECS:
  _define, _args = _spec.definition()
  getattr(flags, _define)(*_args)

FLAGS = flags.FLAGS
_PROGRAM = "train"


def make_params(f, visible_gpus):
  """Turns parsed flags into validated `TrainParams` (devices resolved).

  Args:
    f: the parsed `flags.FLAGS`.
    visible_gpus: how many GPUs TensorFlow sees.

  Returns:
    Validated `params.TrainParams`.

  Raises:
    params.ParamsError: for a bad value.
  """
  gpus = visible_gpus
  device = f.device
  if device == "auto":
    device = "gpu" if gpus else "cpu"
  num_towers = f.num_towers
  if device == "gpu" and not gpus:
    # Said before the tower count, which would otherwise default to 0 and
    # blame a --num_towers the user never gave.
    raise params_lib.ParamsError(
        "--device=gpu%s, but TensorFlow sees no GPU (0 GPU(s) are visible): "
        "use --device=cpu, or install TensorFlow with GPU support "
        "(TF1_SAFE_TRAIN_GPU=1 ./bazelw ..., see the README's Install) "
        "and check that the driver sees the GPU" % (
            "" if num_towers is None else " --num_towers=%s" % num_towers))
  if num_towers is None:
    num_towers = gpus if device == "gpu" else params_lib.TrainParams.num_towers
  if device == "gpu" and isinstance(num_towers, int) and num_towers > gpus:
    raise params_lib.ParamsError(
        "--num_towers=%d with --device=gpu, but %d GPU(s) are visible" %
        (num_towers, gpus))
  values = flag_specs.flag_values(params_lib.TrainParams, f)
  values.update(train_dir=cli.resolve_path(f.train_dir),
                data_dir=cli.resolve_path(f.data_dir),
                num_towers=num_towers, device=device)
  return params_lib.TrainParams(**values).validate()


def make_cluster(f, environ):
  """The cluster from TF_CONFIG or the cluster flags, or None (one machine).

  Raises:
    cluster.ClusterSpecError: for a bad spec, or both sources given.
  """
  return cluster_flags.resolve(environ.get(cluster_lib.TF_CONFIG), f.ps_hosts,
                               f.worker_hosts, f.job_name, f.task_index)


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  try:  # Before TensorFlow's import: a bad cluster spec fails at once.
    cluster = make_cluster(FLAGS, os.environ)
  except cluster_lib.ClusterSpecError as e:
    cli.fail(_PROGRAM, e)
  fresh = _fresh_train_dir_unless_given(cluster)
  params = _preflight(cluster)
  if fresh:  # Once the run is not refused: its first line.
    sys.stderr.write("%s: --train_dir=%s (a fresh directory; pass "
                     "--train_dir to choose one, the same one to resume)\n"
                     % (_PROGRAM, fresh))
    sys.stderr.flush()
  warning = params and preflight.towers_warning(params)
  if warning and (cluster is None or cluster.job_name != cluster_lib.PS):
    logging.warning(warning)
  cli.raise_on_sigterm_during_start_up()
  try:
    _run(cluster)
  except KeyboardInterrupt as e:
    # Ctrl-C or SIGTERM before the trainer's own handlers are installed
    # (TensorFlow's import, graph building): nothing was trained yet.
    cli.start_up_interrupted(_PROGRAM, e)


def _fresh_train_dir_unless_given(cluster):
  """Without --train_dir, a fresh directory's path (a fixed default would be
  resumed by a forgotten flag), else None; required in a cluster."""
  if FLAGS.train_dir:
    return None
  if cluster is not None:
    cli.fail(_PROGRAM, "--train_dir is required in a cluster (every task "
             "names the same directory)")
  FLAGS.train_dir = train_dir_lib.fresh()
  return FLAGS.train_dir


def _preflight(cluster):
  """Refuses bad input before TensorFlow's import, where that needs no
  TensorFlow (`preflight`); the same checks run again after it. Returns the
  params, or None when only TensorFlow can make them."""
  gpus = preflight.visible_gpus(FLAGS.device)
  if gpus is None:
    return None  # Only TensorFlow knows the GPUs --device and towers need.
  try:
    params = make_params(FLAGS, gpus)
    preflight.check(params, cluster.num_workers if cluster else None)
  except (params_lib.ParamsError, injection_spec.InjectionSpecError,
          train_dir_lib.TrainDirError, preflight.DataError) as e:
    cli.fail(_PROGRAM, e)
  return params


def _run(cluster):
  """Runs this task (trainer or ps) of `cluster` (None: one machine)."""
  tf = cli.import_tensorflow(logging.INFO)
  # pylint: disable=g-import-not-at-top
  from tf1_safe_train.cluster import replicas
  from tf1_safe_train.cluster import replication
  from tf1_safe_train.data import cifar10
  from tf1_safe_train.trainer.recovery import checkpoint_rollback
  from tf1_safe_train.trainer.checkpoint import checkpoints
  from tf1_safe_train.trainer.drills import injection
  from tf1_safe_train.trainer.tower import tower_unit
  from tf1_safe_train.trainer.run import train_lib
  # pylint: enable=g-import-not-at-top
  try:
    params = make_params(FLAGS, len(tf.config.list_physical_devices("GPU")))
    # Every task checks the drill, so a bad WORKER fails the ps tasks too.
    injection.validate(injection.parse_spec(params.inject_nonfinite),
                       params.num_towers,
                       cluster.num_workers if cluster else 1,
                       params.inject_into)
    if cluster is not None and checkpoint_rollback.refusal_in_cluster(params):
      # Every task, so no ps serves workers that refused to start.
      raise params_lib.ParamsError(
          checkpoint_rollback.refusal_in_cluster(params))
    if cluster is not None and tower_unit.refusal_in_cluster(params):
      raise params_lib.ParamsError(tower_unit.refusal_in_cluster(params))
    if cluster is not None and cluster.job_name == cluster_lib.PS:
      # A ps blocks in TensorFlow (a Python handler would never run);
      # Ctrl-C and SIGTERM must end it at once.
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      signal.signal(signal.SIGTERM, signal.SIG_DFL)
      replicas.serve_parameter_server(cluster, params)
      return
    # A step too large for memory crashes inside TensorFlow (see
    # crash_report) rather than raising ResourceExhaustedError.
    crash_report.install(_PROGRAM, (
        "during training, most likely out of memory with --batch_size=%d on "
        "%d tower(s); lower --batch_size (or --num_towers); TensorFlow's "
        "oneDNN kernels crash when an allocation fails" % (
            params.batch_size, params.num_towers)))
    # The trainer is built without the cluster: its strategy comes from here.
    summary = train_lib.train(
        params, strategy=replication.make(params, cluster))
  except (params_lib.ParamsError, cifar10.DataError,
          injection.InjectionSpecError, train_lib.TrainDirError,
          checkpoints.CheckpointError) as e:
    cli.fail(_PROGRAM, e)
  except cluster_lib.ClusterError as e:  # A ps unreachable, a port in use.
    cli.fail(_PROGRAM, e, 1)
  except (tf.errors.OpError, OSError) as e:
    _fail_on_error(tf, e, params)
  _report_end(params, summary)


def _fail_on_error(tf, e, params):
  """Ends the program on the run's error `e`, saying what to do."""
  if disk_full.path_of(e) is not None:
    # TensorFlow reports it as ResourceExhaustedError, as a failed
    # allocation, but a smaller --batch_size would not help.
    cli.fail_now(_PROGRAM, "%s; free space on that disk (or train in a "
                 "--train_dir on another); the last complete checkpoint "
                 "there is intact and a rerun resumes from it" %
                 disk_full.describe(e), 1)
  if isinstance(e, OSError):
    raise e
  if isinstance(e, tf.errors.ResourceExhaustedError):
    # Not sys.exit: after an OOM, TensorFlow's threads may still hold or
    # free huge buffers while Python tears down, which ended in a segfault
    # and a thread dump after the message.
    cli.fail_now(_PROGRAM, "out of memory (%s) with --batch_size=%d on %d "
                 "tower(s); lower --batch_size (or --num_towers); the last "
                 "checkpoint in %s is intact" % (
                     cli.describe_op_error(e), params.batch_size,
                     params.num_towers, params.train_dir), 1)
  cli.fail(_PROGRAM, cli.describe_op_error(e), 1)


def _report_end(params, summary):
  """Ends the program of a run that gave up (its reason, the last good
  checkpoint)."""
  # pylint: disable=g-import-not-at-top
  from tf1_safe_train.trainer.recovery import checkpoint_rollback_target
  # (The run's last line, naming the run summary, is train_lib's: run_story.)
  if summary["exit_reason"] == "nonfinite_state":
    cli.fail(_PROGRAM, summary["nonfinite_state"], 1)
  refused = ("; " + summary["rollback_refused"]
             if "rollback_refused" in summary else "")
  if summary["exit_reason"] == "model_fault":
    cli.fail(_PROGRAM, "stopped at step %d: every batch fails on these "
             "weights: the model, not the data (skip of step %d in "
             "skips.jsonl; nothing excluded)%s; %s" % (
                 summary["global_step"], summary["model_fault_step"], refused,
                 _last_good(checkpoint_rollback_target, params, summary)), 1)
  if summary["exit_reason"] == "too_many_consecutive_skips":
    cli.fail(_PROGRAM, "gave up after %d consecutive skipped steps at step "
             "%d (--max_consecutive_skips=%d)%s; %s" % (
                 summary["consecutive_skips"], summary["global_step"],
                 params.max_consecutive_skips, refused,
                 _last_good(checkpoint_rollback_target, params, summary)), 1)


def _last_good(target, params, summary):
  """Which checkpoint holds the last good state of a run that gave up.

  Every checkpoint since the streak began holds the weights its steps
  failed on (a skip changes nothing); if the last applied step wrecked the
  model they are not good, so the line names the one before that step, in
  the run's history (`target`: `checkpoint_rollback_target.last_good`;
  pruning keeps it: `checkpoints.FiniteSaver`).
  """
  start = summary["global_step"] - (
      summary["consecutive_skips"] if params.increment_global_step_on_skip
      else 0)
  path, restored = target.last_good(
      params.train_dir, summary["applied_steps"],
      summary.get("rollback_count", 0), summary.get("rollback_to_step", -1),
      params.rollback_min_applied_steps > 0)
  if path is None:
    return ("the streak began at step %d and no checkpoint in %s predates "
            "the last step applied before it; the later checkpoints hold the "
            "weights every skipped step failed on" % (start,
                                                      params.train_dir))
  if restored:
    return ("the streak began at step %d: %s in %s, which the last rollback "
            "restored (no step applied since; steps were applied after it "
            "before), is the last good state (not the checkpoints of the "
            "window it abandoned)" % (start, os.path.basename(path),
                                      params.train_dir))
  return ("the streak began at step %d: %s in %s, written before the last "
          "step applied before it, is kept (the later checkpoints hold the "
          "weights every skipped step failed on)" % (
              start, os.path.basename(path), params.train_dir))


_SHORT_HELP = frozenset(["-?", "-h", "--help", "--helpshort"])


def parse_flags(argv):
  """`cli.flags_parser`, but --help lists the flags by concept, common ones
  first (`flag_groups`), and a tf_cnn_benchmarks flag (--num_batches...)
  is answered with ours in one line, not absl's "Did you mean"."""
  arguments = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  foreign = flag_groups.foreign_flag(argv)
  if foreign:
    cli.fail(_PROGRAM, "%s is tf_cnn_benchmarks' flag; here use %s" %
             foreign)
  if any(arg.split("=")[0] in _SHORT_HELP for arg in arguments):
    usage = __doc__.replace("./bazelw run //:train --",  # As it was run.
                            console.command(_PROGRAM))
    sys.stdout.write("%s\nflags of %s, by concept:\n%s" % (
        usage, os.path.abspath(__file__), flag_groups.help_text(_SPECS)))
    sys.exit(0)
  return cli.flags_parser(_PROGRAM)(argv)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
