r"""`//:eval`: precision@1 and loss of the latest checkpoint of --train_dir.

  ./bazelw run //:eval -- --train_dir=/tmp/run1
"""

from absl import app
from absl import flags
from absl import logging

from tf1_safe_train import cli
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.config import recorded_params

# Declared in params.EvalParams; defined here, so that absl files them under
# this binary (--helpshort).
for _spec in flag_specs.of_params(params_lib.EvalParams):
  _define, _args = _spec.definition()
  getattr(flags, _define)(*_args)

FLAGS = flags.FLAGS
_PROGRAM = "eval"


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  params = _params()
  tf = cli.import_tensorflow(logging.INFO)
  # pylint: disable=g-import-not-at-top
  from tf1_safe_train.data import cifar10
  from tf1_safe_train.trainer.run import eval_lib
  # pylint: enable=g-import-not-at-top
  try:
    result = eval_lib.evaluate(params)
  except (params_lib.ParamsError, cifar10.DataError,
          eval_lib.NoCheckpointError) as e:
    cli.fail(_PROGRAM, e)
  except (eval_lib.NonFiniteCheckpointError,
          eval_lib.NonFiniteLossError) as e:
    cli.fail(_PROGRAM, e, 1)
  except tf.errors.NotFoundError as e:
    if "not found in checkpoint" not in str(e):
      cli.fail(_PROGRAM, cli.describe_op_error(e), 1)
    # A run records its model when it ends (run_summary.json): one still
    # going is evaluated with --model, whose default may not be its model.
    cli.fail(_PROGRAM, "%s: the checkpoint holds another model than "
             "--model=%s; pass the run's --model" % (
                 cli.describe_op_error(e), params.model))
  except tf.errors.OpError as e:
    cli.fail(_PROGRAM, cli.describe_op_error(e), 1)
  print("eval: step %d  precision@1 %.4f  loss %.4f  (%d examples%s)" % (
      result["global_step"], result["precision_at_1"], result["loss"],
      result["num_examples"], ", EMA weights" if result["used_ema"] else ""))


def _params():
  """The validated `EvalParams`: the flags, and the run's recorded model and
  data for those not given (`recorded_params`); before TensorFlow's import.
  """
  if not FLAGS.train_dir:
    cli.fail(_PROGRAM, "--train_dir is required: the training run's "
             "directory")
  train_dir = cli.resolve_path(FLAGS.train_dir)
  values = flag_specs.flag_values(params_lib.EvalParams, FLAGS)
  values.update(train_dir=train_dir,
                data_dir=cli.resolve_path(FLAGS.data_dir))
  given = [name for name in values if FLAGS[name].present]
  try:
    if not recorded_params.EVAL_FIELDS <= set(given):  # Else not needed.
      values = recorded_params.for_eval(
          values, given, recorded_params.read(train_dir), train_dir)
    return params_lib.EvalParams(**values).validate()
  except params_lib.ParamsError as e:
    cli.fail(_PROGRAM, e)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
