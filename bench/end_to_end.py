r"""`//bench:end_to_end`: `//:train` against a tf_cnn_benchmarks-style loop.

  ./bazelw run //bench:end_to_end
  ./bazelw run //bench:end_to_end -- --models=resnet20 --num_towers=2,4
  ./bazelw run //bench:end_to_end -- --quick

Prints the side-by-side table (with its A/A control) and each
configuration's breakdown, and writes the results as JSON to --json_out.
Flags live here and only here; `end_to_end_lib.run` does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli

_PROGRAM = "end_to_end"
# Same defaults as end_to_end_lib.EndToEndConfig (flags are parsed before
# TensorFlow starts, and the lib imports it).
flags.DEFINE_list("models", ["small_cnn", "resnet20"], "Models to compare.")
flags.DEFINE_list("num_towers", ["1", "2", "4"],
                  "Tower counts to compare (virtual CPU devices).")
flags.DEFINE_integer("batch_size", 32, "Examples per tower per step.")
flags.DEFINE_integer("warmup_steps", 10, "Untimed steps of each variant.")
flags.DEFINE_integer("rounds", 8, "Rounds: each times a block of every "
                     "variant (rounds x steps_per_block //:train steps: "
                     "200 holds one checkpoint, as --save_checkpoints_steps).")
flags.DEFINE_integer("steps_per_block", 25, "Steps per timed block.")
flags.DEFINE_integer("seed", 0, "Graph-level seed.")
flags.DEFINE_bool("quick", False, "A smoke run in seconds: small_cnn, 1 "
                  "tower, batch 8, 2 rounds of 2 steps (overrides those "
                  "flags; its figures mean nothing).")
flags.DEFINE_string("json_out", "/tmp/end_to_end.json",
                    "Where to write the results as JSON ('' = nowhere).")
flags.DEFINE_string("markdown_out", "", "Where to write the tables too.")

FLAGS = flags.FLAGS


def make_config(f, lib):
  """Turns parsed flags into a validated `EndToEndConfig`.

  Raises:
    ValueError: for a bad value.
  """
  if f.quick:
    return lib.EndToEndConfig(models=("small_cnn",), num_towers=(1,),
                              batch_size=8, warmup_steps=2, rounds=2,
                              steps_per_block=2, seed=f.seed).validate()
  try:
    num_towers = tuple(int(n) for n in f.num_towers)
  except ValueError:
    raise ValueError("--num_towers=%s: must be comma-separated integers" %
                     ",".join(f.num_towers)) from None
  return lib.EndToEndConfig(
      models=tuple(f.models), num_towers=num_towers,
      batch_size=f.batch_size, warmup_steps=f.warmup_steps, rounds=f.rounds,
      steps_per_block=f.steps_per_block, seed=f.seed).validate()


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  logging.set_verbosity(logging.INFO)
  cli.import_tensorflow()
  from bench import end_to_end_lib  # pylint: disable=g-import-not-at-top
  from tf1_safe_train.trainer.config import params as params_lib  # pylint: disable=g-import-not-at-top
  try:
    config = make_config(FLAGS, end_to_end_lib)
  except (ValueError, params_lib.ParamsError) as e:
    cli.fail(_PROGRAM, e)
  results = end_to_end_lib.run(config, log_fn=logging.info)
  timing.publish(results, end_to_end_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out),
                 cli.resolve_path(FLAGS.markdown_out) if FLAGS.markdown_out
                 else "", logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
