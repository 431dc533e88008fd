r"""`//bench:towers`: trainer examples/s against --num_towers, and the input.

  ./bazelw run //bench:towers
  ./bazelw run //bench:towers -- --model=small_cnn --num_towers=1,2

Prints a Markdown table and writes the results as JSON to --json_out. Flags
live here and only here; `towers_lib.run(TowersConfig(...))` does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli
from tf1_safe_train.trainer.config import params as params_lib

_PROGRAM = "towers"
# Same defaults as towers_lib.TowersConfig (flags are parsed before
# TensorFlow starts, and towers_lib imports it).
flags.DEFINE_enum("model", "resnet20", params_lib.MODELS, "The model.")
flags.DEFINE_integer("batch_size", 32, "Examples per tower per step.")
flags.DEFINE_list("num_towers", ["1", "2", "4"],
                  "Tower counts to compare (virtual CPU devices).")
flags.DEFINE_integer("warmup_steps", 5, "Untimed steps of each configuration.")
flags.DEFINE_integer("rounds", 5, "Round-robin rounds.")
flags.DEFINE_integer("steps_per_block", 10, "Steps per timed block.")
flags.DEFINE_integer("seed", 0, "Graph-level seed and shuffle seed.")
flags.DEFINE_string("json_out", "/tmp/towers.json",
                    "Where to write the results as JSON ('' = nowhere).")

FLAGS = flags.FLAGS


def make_config(f, lib):
  """Turns parsed flags into a validated `TowersConfig`.

  Raises:
    ValueError: for a bad value.
  """
  try:
    num_towers = tuple(int(n) for n in f.num_towers)
  except ValueError:
    raise ValueError("--num_towers=%s: must be comma-separated integers" %
                     ",".join(f.num_towers)) from None
  return lib.TowersConfig(
      model=f.model, batch_size=f.batch_size, num_towers=num_towers,
      warmup_steps=f.warmup_steps, rounds=f.rounds,
      steps_per_block=f.steps_per_block, seed=f.seed).validate()


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  logging.set_verbosity(logging.INFO)
  cli.import_tensorflow()
  from bench import towers_lib  # pylint: disable=g-import-not-at-top
  try:
    config = make_config(FLAGS, towers_lib)
  except (ValueError, params_lib.ParamsError) as e:
    cli.fail(_PROGRAM, e)
  results = towers_lib.run(config, log_fn=logging.info)
  timing.publish(results, towers_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out), "", logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
