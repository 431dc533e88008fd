r"""`//bench:sdc`: one tower's finite faults, and what catches them.

  ./bazelw run //bench:sdc               # the docs' tables, under an hour
  ./bazelw run //bench:sdc -- --quick    # a few minutes: checks it runs

Prints Markdown tables (per model and fault kind, the fraction caught by
each detection configuration, and among faults that move the applied update
by more than 10%; false positives on a clean stretch, executed nodes and
time ratio of a good step beside an A/A control, precision@1 after one bit
flip per 100 steps) and writes the results as JSON to --json_out. Flags
live here and only here; `sdc_lib.run(SdcConfig(...))` does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli

_PROGRAM = "sdc"
flags.DEFINE_list("models", ["small_cnn", "resnet20"], "Models measured.")
flags.DEFINE_list("clean_steps", ["2000", "500"],
                  "Per model: clean steps before the faults (their skips "
                  "are false positives).")
flags.DEFINE_list("precision_steps", ["1000", "500"],
                  "Per model: steps of the precision runs (one bit flip per "
                  "100 steps).")
flags.DEFINE_integer("faults_per_kind", 100, "Faults of each kind per run.")
flags.DEFINE_integer("batch_size", 8, "Examples per tower per step.")
flags.DEFINE_list("detections", ["off", "spike", "tower_outliers"],
                  "Detection configurations (sdc_lib.DETECTIONS), by name.")
flags.DEFINE_boolean("quick", False, "small_cnn, a few faults: checks it "
                     "runs.")
flags.DEFINE_string("json_out", "/tmp/sdc.json",
                    "Where to write the results as JSON ('' = nowhere).")
flags.DEFINE_string("markdown_out", "",
                    "Also write the Markdown tables here ('' = nowhere).")

FLAGS = flags.FLAGS


def _config(sdc_lib):
  if FLAGS.quick:
    return sdc_lib.quick_config()
  known = {d.name: d for d in sdc_lib.DETECTIONS}
  unknown = [n for n in FLAGS.detections if n not in known]
  if unknown:
    raise ValueError("--detections: unknown %s (known: %s)" %
                     (", ".join(unknown), ", ".join(known)))
  try:
    clean = tuple(int(s) for s in FLAGS.clean_steps)
    steps = tuple(int(s) for s in FLAGS.precision_steps)
  except ValueError:
    raise ValueError("--clean_steps and --precision_steps must be integers")
  return sdc_lib.SdcConfig(
      models=tuple(FLAGS.models), clean_steps=clean, precision_steps=steps,
      faults_per_kind=FLAGS.faults_per_kind, batch_size=FLAGS.batch_size,
      # Off first, always: the cost baseline.
      detections=tuple(known[n] for n in ["off"] + [
          n for n in FLAGS.detections if n != "off"])).validate()


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  cli.import_tensorflow()
  from bench import sdc_lib  # pylint: disable=g-import-not-at-top
  try:
    config = _config(sdc_lib)
  except ValueError as e:
    cli.fail(_PROGRAM, e)
  # The runs' own progress lines would bury the tables.
  logging.set_verbosity(logging.ERROR)
  results = sdc_lib.run(config, log_fn=lambda line: print(line, flush=True))
  timing.publish(results, sdc_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out),
                 cli.resolve_path(FLAGS.markdown_out), logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
