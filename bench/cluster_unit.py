r"""`//bench:cluster_unit`: one flaky worker in three, the worker unit off,
on, and on with quarantine, on a loopback cluster.

  ./bazelw run //bench:cluster_unit               # the docs' table, minutes
  ./bazelw run //bench:cluster_unit -- --quick    # checks it runs

Prints a Markdown table (applied steps, worker pushes left out, examples
applied and per second of the chief's run) and writes the results as JSON
to --json_out. The clusters run in a network namespace of their own where
the machine allows it (as `//:local_cluster`'s). Flags live here and only
here; `cluster_unit_lib.run(...)` does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli
from tf1_safe_train.cluster import private_network

_PROGRAM = "cluster_unit"
flags.DEFINE_integer("max_steps", 200, "Steps of each run.")
flags.DEFINE_integer("batch_size", 16, "Examples per worker per step.")
flags.DEFINE_float("probability", 0.05,
                   "Chance per step that the flaky worker's gradients are "
                   "NaN.")
flags.DEFINE_integer("seed", 0, "Seed of the runs (and of the drill).")
flags.DEFINE_list("modes", "off,on,on+quarantine",
                  "Which runs, in this order (some of off, on, "
                  "on+quarantine).")
flags.DEFINE_boolean("quick", False,
                     "12 steps, the on+quarantine run only: checks it runs.")
flags.DEFINE_string("json_out", "/tmp/cluster_unit.json",
                    "Where to write the results as JSON ('' = nowhere).")
flags.DEFINE_string("markdown_out", "",
                    "Also write the Markdown table here ('' = nowhere).")

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  # Before any thread starts (the library's imports may start some).
  why_not = private_network.isolate()
  from bench import cluster_unit_lib  # pylint: disable=g-import-not-at-top
  try:
    if FLAGS.quick:
      config = cluster_unit_lib.quick_config()
    else:
      config = cluster_unit_lib.ClusterUnitConfig(
          max_steps=FLAGS.max_steps, batch_size=FLAGS.batch_size,
          probability=FLAGS.probability, seed=FLAGS.seed,
          modes=tuple(FLAGS.modes)).validate()
  except ValueError as e:
    cli.fail(_PROGRAM, e)
  if why_not is not None:
    logging.warning("no private network namespace (%s): the clusters' gRPC "
                    "ports listen on every interface", why_not)
  results = cluster_unit_lib.run(config,
                                 log_fn=lambda line: print(line, flush=True))
  timing.publish(results, cluster_unit_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out),
                 cli.resolve_path(FLAGS.markdown_out), logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
