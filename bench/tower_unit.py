r"""`//bench:tower_unit`: one flaky tower in four, --skip_unit=step vs tower.

  ./bazelw run //bench:tower_unit               # the docs' table, minutes
  ./bazelw run //bench:tower_unit -- --quick    # about a minute: runs

Prints a Markdown table (examples applied, per wall and CPU second, test
precision@1, executed nodes per good step) and writes the results as JSON
to --json_out. Flags live here and only here; `tower_unit_lib.run(...)`
does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli

_PROGRAM = "tower_unit"
flags.DEFINE_integer("max_steps", 300, "Steps of each run.")
flags.DEFINE_integer("batch_size", 16, "Examples per tower per step.")
flags.DEFINE_float("probability", 0.05,
                   "Chance per step that the flaky tower's gradients are NaN.")
flags.DEFINE_integer("seed", 0, "Seed of the runs (and of the drill).")
flags.DEFINE_boolean("quick", False, "20 steps: checks it runs.")
flags.DEFINE_string("json_out", "/tmp/tower_unit.json",
                    "Where to write the results as JSON ('' = nowhere).")
flags.DEFINE_string("markdown_out", "",
                    "Also write the Markdown table here ('' = nowhere).")

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  cli.import_tensorflow()
  from bench import tower_unit_lib  # pylint: disable=g-import-not-at-top
  try:
    if FLAGS.quick:
      config = tower_unit_lib.quick_config()
    else:
      config = tower_unit_lib.TowerUnitConfig(
          max_steps=FLAGS.max_steps, batch_size=FLAGS.batch_size,
          probability=FLAGS.probability, seed=FLAGS.seed).validate()
  except ValueError as e:
    cli.fail(_PROGRAM, e)
  # The runs' own progress lines would bury the table.
  logging.set_verbosity(logging.ERROR)
  results = tower_unit_lib.run(config, log_fn=lambda line: print(line,
                                                                  flush=True))
  timing.publish(results, tower_unit_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out),
                 cli.resolve_path(FLAGS.markdown_out), logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
