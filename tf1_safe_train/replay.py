r"""`//:replay`: re-runs a recorded skipped step and prints its report.

  ./bazelw run //:replay -- --train_dir=/tmp/run1 --step=3

The step must have been explained during the run (see docs/forensics.md:
--max_explained_skips): its state, batch and params are in
<train_dir>/skips/step-N-K/. The report is the run's log line for that skip.
A step that skipped more than once has a record per skip: the newest is
replayed unless --record picks another.
"""

from absl import app
from absl import flags
from absl import logging

from tf1_safe_train import cli

flags.DEFINE_string("train_dir", None, "The training run's directory.")
flags.DEFINE_integer("step", None, "The skipped step to replay (its "
                     "skips.jsonl record's step).")
flags.DEFINE_integer("worker", 0, "Cluster: the worker whose skip it was.")
flags.DEFINE_integer("record", 0, "Which record of the step, 1 for the "
                     "first written (a step can skip more than once); 0: "
                     "the newest.")

FLAGS = flags.FLAGS
_PROGRAM = "replay"


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  for name in ("train_dir", "step"):
    if getattr(FLAGS, name) in (None, ""):
      cli.fail(_PROGRAM, "--%s is required" % name)
  for name in ("worker", "record"):
    if getattr(FLAGS, name) < 0:
      cli.fail(_PROGRAM, "--%s=%d: must be >= 0" % (name, getattr(FLAGS,
                                                                   name)))
  tf = cli.import_tensorflow(logging.WARNING)
  # pylint: disable=g-import-not-at-top
  from tf1_safe_train.trainer.explain import offline_replay
  # pylint: enable=g-import-not-at-top
  try:
    record, explained, line = offline_replay.replay_recorded(
        cli.resolve_path(FLAGS.train_dir), FLAGS.step, FLAGS.worker,
        FLAGS.record)
  except offline_replay.ReplayError as e:
    cli.fail(_PROGRAM, e)
  except tf.errors.OpError as e:
    cli.fail(_PROGRAM, cli.describe_op_error(e), 1)
  print(line)
  print("recorded during the run: %s" % record.get("verdict"))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
