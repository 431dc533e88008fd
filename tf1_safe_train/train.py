r"""`//:train`: the multi-tower trainer. Flags live here and only here.

  ./bazelw run //:train -- --num_towers=2 --max_steps=600 \
      --inject_nonfinite=nan@100:1,inf@300:0 --train_dir=/tmp/run1

In a cluster (TF_CONFIG, or --ps_hosts/--worker_hosts/--job_name/
--task_index) the same binary runs one task: a ps serves until every worker
has finished; a worker trains (worker 0 is the chief).
"""

import os
import signal

from absl import app
from absl import flags
from absl import logging

from tf1_safe_train import cli
from tf1_safe_train import cluster as cluster_lib
from tf1_safe_train import crash_report
from tf1_safe_train import params as params_lib

_DEFAULTS = params_lib.TrainParams()

flags.DEFINE_string("train_dir", _DEFAULTS.train_dir,
                    "Checkpoints, summaries and run_summary.json; re-running "
                    "with the same directory resumes.")
flags.DEFINE_enum("model", _DEFAULTS.model, params_lib.MODELS, "The model.")
flags.DEFINE_enum("dataset", _DEFAULTS.dataset, params_lib.DATASETS,
                  "synthetic (embedded, learnable) or cifar10 (binary files "
                  "in --data_dir).")
flags.DEFINE_string("data_dir", "", "Folder of the CIFAR-10 .bin files.")
flags.DEFINE_integer("num_towers", None,
                     "Towers (model replicas); default: every visible GPU, "
                     "or 2 with none.")
flags.DEFINE_enum("device", "auto", ("auto",) + params_lib.DEVICES,
                  "Where towers run: gpu (/gpu:i), cpu (virtual CPU device i) "
                  "or auto (gpu if any is visible).")
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size,
                     "Examples per tower per step.")
flags.DEFINE_enum("optimizer", _DEFAULTS.optimizer, params_lib.OPTIMIZERS,
                  "The optimizer (momentum is 0.9).")
flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate,
                   "Initial learning rate.")
flags.DEFINE_enum("lr_schedule", _DEFAULTS.lr_schedule, params_lib.LR_SCHEDULES,
                  "constant, piecewise (x0.1 at 50% and 75% of --max_steps) "
                  "or cosine.")
flags.DEFINE_enum("lr_schedule_step", _DEFAULTS.lr_schedule_step,
                  params_lib.LR_STEPS,
                  "The counter the schedule follows: applied_steps (skipped "
                  "steps do not decay the rate) or global_step.")
flags.DEFINE_float("weight_decay", _DEFAULTS.weight_decay,
                   "L2 weight decay on the weights (not biases or BN).")
flags.DEFINE_float("clip_gradient_norm", _DEFAULTS.clip_gradient_norm,
                   "Clip gradients to this global norm after the finite "
                   "check; 0 = off.")
flags.DEFINE_float("moving_average_decay", _DEFAULTS.moving_average_decay,
                   "EMA of the weights (updated only on applied steps); "
                   "0 = off.")
flags.DEFINE_boolean("increment_global_step_on_skip",
                     _DEFAULTS.increment_global_step_on_skip,
                     "Advance global_step on skipped steps too (it counts "
                     "batches, so --max_steps ends the run).")
flags.DEFINE_integer("max_steps", _DEFAULTS.max_steps,
                     "Stop when global_step reaches this.")
flags.DEFINE_integer("max_consecutive_skips", _DEFAULTS.max_consecutive_skips,
                     "Give up (exit 1) after this many skipped steps in a "
                     "row; 0 = never.")
flags.DEFINE_integer("save_checkpoints_steps", _DEFAULTS.save_checkpoints_steps,
                     "Checkpoint every this many steps (and at the end).")
flags.DEFINE_integer("save_summaries_steps", _DEFAULTS.save_summaries_steps,
                     "TensorBoard summaries every this many steps.")
flags.DEFINE_integer("log_every_n_steps", _DEFAULTS.log_every_n_steps,
                     "Progress line every this many steps.")
flags.DEFINE_string("inject_nonfinite", "",
                    "Fault drill: comma-separated KIND@STEPS[:TOWER][/WORKER] "
                    "or KIND%PROB[:TOWER][/WORKER] (KIND nan|inf|-inf; STEPS "
                    "N, N-M or N-; TOWER and WORKER default to 0), e.g. "
                    "nan@100:1,inf%0.01,nan@10-20:0/1.")
flags.DEFINE_enum("inject_into", _DEFAULTS.inject_into, params_lib.INJECT_INTO,
                  "What the drill poisons: a tower's grads, loss or input "
                  "images.")
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Graph-level random seed.")
flags.DEFINE_string("ps_hosts", "",
                    "Cluster: comma-separated host:port of the parameter "
                    "servers (or use TF_CONFIG, not both).")
flags.DEFINE_string("worker_hosts", "",
                    "Cluster: comma-separated host:port of the workers; "
                    "worker 0 is the chief.")
flags.DEFINE_string("job_name", "", "Cluster: this task's job, ps or worker.")
flags.DEFINE_integer("task_index", 0, "Cluster: this task's index in its job.")
flags.DEFINE_enum("precision", _DEFAULTS.precision, params_lib.PRECISIONS,
                  "Compute precision (float32 master weights): fp32, fp16 "
                  "(with dynamic loss scaling) or bf16.")
flags.DEFINE_float("initial_loss_scale", _DEFAULTS.initial_loss_scale,
                   "fp16: the starting loss scale.")
flags.DEFINE_integer("loss_scale_growth_steps",
                     _DEFAULTS.loss_scale_growth_steps,
                     "fp16: double the loss scale after this many applied "
                     "steps in a row (a skip halves it, floor 1).")
flags.DEFINE_boolean("sync_replicas", _DEFAULTS.sync_replicas,
                     "Cluster: aggregate every worker's gradients and decide "
                     "apply/skip on the aggregate (one poisoned replica skips "
                     "the step for all); false: each worker's step is applied "
                     "or skipped on its own.")
flags.DEFINE_float("startup_timeout_secs", _DEFAULTS.startup_timeout_secs,
                   "Cluster: how long a worker waits for the parameter "
                   "servers (and for the chief to initialise the model), at "
                   "start-up and for a ps lost mid-run.")

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
        "(TF1_SAFE_TRAIN_GPU=1 ./bazelw ..., see the README's quick start) "
        "and check that the driver sees the GPU" % (
            "" if num_towers is None else " --num_towers=%s" % num_towers))
  if num_towers is None:
    num_towers = gpus if device == "gpu" else 2
  if device == "gpu" and isinstance(num_towers, int) and num_towers > gpus:
    raise params_lib.ParamsError(
        "--num_towers=%d with --device=gpu, but %d GPU(s) are visible" %
        (num_towers, gpus))
  return params_lib.TrainParams(
      train_dir=cli.resolve_path(f.train_dir),
      model=f.model,
      dataset=f.dataset,
      data_dir=cli.resolve_path(f.data_dir),
      num_towers=num_towers,
      device=device,
      batch_size=f.batch_size,
      optimizer=f.optimizer,
      learning_rate=f.learning_rate,
      lr_schedule=f.lr_schedule,
      lr_schedule_step=f.lr_schedule_step,
      weight_decay=f.weight_decay,
      clip_gradient_norm=f.clip_gradient_norm,
      moving_average_decay=f.moving_average_decay,
      increment_global_step_on_skip=f.increment_global_step_on_skip,
      max_steps=f.max_steps,
      max_consecutive_skips=f.max_consecutive_skips,
      save_checkpoints_steps=f.save_checkpoints_steps,
      save_summaries_steps=f.save_summaries_steps,
      log_every_n_steps=f.log_every_n_steps,
      inject_nonfinite=f.inject_nonfinite,
      inject_into=f.inject_into,
      seed=f.seed,
      sync_replicas=f.sync_replicas,
      precision=f.precision,
      initial_loss_scale=f.initial_loss_scale,
      loss_scale_growth_steps=f.loss_scale_growth_steps,
      startup_timeout_secs=f.startup_timeout_secs).validate()


def make_cluster(f, environ):
  """The cluster from TF_CONFIG or the cluster flags, or None (one machine).

  Raises:
    cluster.ClusterSpecError: for a bad spec, or both sources given.
  """
  return cluster_lib.resolve(environ.get(cluster_lib.TF_CONFIG), f.ps_hosts,
                             f.worker_hosts, f.job_name, f.task_index)


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  try:  # Before TensorFlow's import: a bad cluster spec fails at once.
    cluster = make_cluster(FLAGS, os.environ)
  except cluster_lib.ClusterSpecError as e:
    cli.fail(_PROGRAM, e)
  try:
    _run(cluster)
  except KeyboardInterrupt:
    # Ctrl-C before the trainer's own handlers are installed (TensorFlow's
    # import, graph building): nothing was trained or written yet.
    cli.fail(_PROGRAM, "interrupted before training started", 130)


def _run(cluster):
  """Runs this task (trainer or ps) of `cluster` (None: one machine)."""
  logging.set_verbosity(logging.INFO)
  tf = cli.import_tensorflow()
  # pylint: disable=g-import-not-at-top
  from tf1_safe_train import checkpoints
  from tf1_safe_train import injection
  from tf1_safe_train import replicas
  from tf1_safe_train import run_summary
  from tf1_safe_train import train_lib
  from tf1_safe_train.data import cifar10
  # pylint: enable=g-import-not-at-top
  try:
    params = make_params(FLAGS, len(tf.config.list_physical_devices("GPU")))
    # Every task checks the drill, so a bad WORKER fails the ps tasks too.
    injection.validate(injection.parse_spec(params.inject_nonfinite),
                       params.num_towers,
                       cluster.num_workers if cluster else 1)
    if cluster is not None and cluster.job_name == cluster_lib.PS:
      # A ps blocks in TensorFlow; Ctrl-C must end it at once.
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      replicas.serve_parameter_server(cluster, params)
      return
    # A step too large for memory crashes inside TensorFlow (see
    # crash_report) rather than raising ResourceExhaustedError.
    crash_report.install(_PROGRAM, (
        "during training, most likely out of memory with --batch_size=%d on "
        "%d tower(s); lower --batch_size (or --num_towers); TensorFlow's "
        "oneDNN kernels crash when an allocation fails" % (
            params.batch_size, params.num_towers)))
    summary = train_lib.train(params, cluster=cluster)
  except (params_lib.ParamsError, cifar10.DataError,
          injection.InjectionSpecError, train_lib.TrainDirError,
          checkpoints.CheckpointError) as e:
    cli.fail(_PROGRAM, e)
  except cluster_lib.ClusterError as e:  # A ps unreachable, a port in use.
    cli.fail(_PROGRAM, e, 1)
  except tf.errors.ResourceExhaustedError as e:
    # Not sys.exit: after an OOM, TensorFlow's threads may still hold or
    # free huge buffers while Python tears down, which ended in a segfault
    # and a thread dump after the message.
    cli.fail_now(_PROGRAM, "out of memory (%s) with --batch_size=%d on %d "
                 "tower(s); lower --batch_size (or --num_towers); the last "
                 "checkpoint in %s is intact" % (
                     cli.describe_op_error(e), params.batch_size,
                     params.num_towers, params.train_dir), 1)
  except tf.errors.OpError as e:
    cli.fail(_PROGRAM, cli.describe_op_error(e), 1)
  if cluster is None or cluster.is_chief:
    logging.info("run summary: %s", os.path.join(params.train_dir,
                                                 run_summary.RUN_SUMMARY))
  if summary["exit_reason"] == "nonfinite_state":
    cli.fail(_PROGRAM, summary["nonfinite_state"], 1)
  if summary["exit_reason"] == "too_many_consecutive_skips":
    cli.fail(_PROGRAM, "gave up after %d consecutive skipped steps at step "
             "%d (--max_consecutive_skips=%d); the last checkpoint in %s "
             "holds the last good state" % (
                 summary["consecutive_skips"], summary["global_step"],
                 params.max_consecutive_skips, params.train_dir), 1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
