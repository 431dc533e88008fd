r"""`//bench:spikes`: finite gradient spikes with and without the option.

  ./bazelw run //bench:spikes               # the docs' table, a few minutes
  ./bazelw run //bench:spikes -- --quick    # about a minute: checks it runs

Prints a Markdown table (test loss and precision@1 over seeds, for the
undisturbed run and each drill without and with --skip_spikes_sigma) and
writes the results as JSON to --json_out. Flags live here and only here;
`spikes_lib.run(SpikesConfig(...))` does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli

_PROGRAM = "spikes"
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the runs.")
flags.DEFINE_integer("max_steps", 300, "Steps of each run.")
flags.DEFINE_list("scales", ["1e3", "1e6"],
                  "Drill factors: each drill multiplies a tower's gradients "
                  "by F at --drill_steps (towers taking turns).")
flags.DEFINE_list("drill_steps", ["150", "220"], "Steps the drills spike.")
flags.DEFINE_float("sigma", 6.0, "--skip_spikes_sigma of the protected runs.")
flags.DEFINE_boolean("quick", False, "One seed, 40 steps: checks it runs.")
flags.DEFINE_string("json_out", "/tmp/spikes.json",
                    "Where to write the results as JSON ('' = nowhere).")
flags.DEFINE_string("markdown_out", "",
                    "Also write the Markdown table here ('' = nowhere).")

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  cli.import_tensorflow()
  from bench import spikes_lib  # pylint: disable=g-import-not-at-top
  try:
    if FLAGS.quick:
      config = spikes_lib.quick_config()
    else:
      config = spikes_lib.SpikesConfig(
          seeds=tuple(int(s) for s in FLAGS.seeds),
          max_steps=FLAGS.max_steps, scales=tuple(FLAGS.scales),
          drill_steps=tuple(int(s) for s in FLAGS.drill_steps),
          sigma=FLAGS.sigma).validate()
  except ValueError as e:
    cli.fail(_PROGRAM, e)
  # The runs' own progress lines would bury the table.
  logging.set_verbosity(logging.ERROR)
  results = spikes_lib.run(config, log_fn=lambda line: print(line,
                                                              flush=True))
  timing.publish(results, spikes_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out),
                 cli.resolve_path(FLAGS.markdown_out), logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
