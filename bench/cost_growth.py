r"""`//bench:cost_growth`: the guard's cost as variables and towers grow.

  ./bazelw run //bench:cost_growth                 # a few minutes on 2 cores
  ./bazelw run //bench:cost_growth -- --quick      # well under a minute
  ./bazelw run //bench:cost_growth -- --dense_variables=100 --models= \
      --num_towers=1,2,4,8 --max_tower_variables=800

Prints a Markdown table (per workload and tower count: each variant's time
and CPU-time ratio to plain `apply_gradients` and the nodes it executes per
step beyond plain's) and writes the full results as JSON to --json_out.
Flags live here and only here; `cost_growth_lib.run(GrowthConfig(...))`
does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli

_PROGRAM = "cost_growth"
# Same defaults as cost_growth_lib.GrowthConfig (it imports TensorFlow, and
# flags are parsed before TensorFlow starts).
flags.DEFINE_list("dense_variables", ["10", "100", "1000"],
                  "Sizes of the dense stacks (one variable per layer).")
flags.DEFINE_list("models", ["small_cnn", "resnet20"],
                  "Reference models measured too.")
flags.DEFINE_list("num_towers", ["1", "2", "4"],
                  "Tower counts (virtual CPU devices).")
flags.DEFINE_integer("max_tower_variables", 1000,
                     "Skip dense stacks whose variables x towers exceed this "
                     "(graph building and optimisation time).")
flags.DEFINE_integer("warmup_steps", 3,
                     "Untimed steps of each variant before tracing and "
                     "timing.")
flags.DEFINE_integer("rounds", 20,
                     "Round-robin rounds per cell; each times one block per "
                     "variant.")
flags.DEFINE_float("min_block_seconds", 0.05,
                   "Steps per timed block: as many as plain runs in this "
                   "time.")
flags.DEFINE_float("max_timing_seconds", 240.0,
                   "Stop a cell's rounds early once the cells' timing has "
                   "taken this long in all (shared evenly; at least 3 rounds "
                   "each).")
flags.DEFINE_boolean("aa_control", True,
                     "Also time a second copy of plain: its ratio shows the "
                     "measurement's noise.")
flags.DEFINE_integer("seed", 0, "Graph-level seed and batch choice.")
flags.DEFINE_boolean("quick", False,
                     "Dense stacks of 10 and 30 variables on 1 and 2 towers, "
                     "3 rounds, no A/A control: checks that everything runs; "
                     "flags given explicitly still win.")
flags.DEFINE_string("json_out", "/tmp/cost_growth.json",
                    "Where to write the results as JSON ('' = nowhere).")
flags.DEFINE_string("markdown_out", "",
                    "Also write the Markdown table here ('' = nowhere).")

FLAGS = flags.FLAGS
_CONFIG_FLAGS = ("dense_variables", "models", "num_towers",
                 "max_tower_variables", "warmup_steps", "rounds",
                 "min_block_seconds", "max_timing_seconds", "aa_control",
                 "seed")
_INT_LISTS = ("dense_variables", "num_towers")


def make_config(f, lib):
  """Turns parsed flags into a validated `GrowthConfig`.

  Args:
    f: the parsed `flags.FLAGS`.
    lib: the `cost_growth_lib` module.

  Returns:
    A validated `lib.GrowthConfig`.

  Raises:
    ValueError: for a bad value.
  """
  values = {}
  for name in _CONFIG_FLAGS:
    if f.quick and not f[name].present:
      continue  # The quick preset's value.
    value = f[name].value
    if name in _INT_LISTS:
      try:
        value = [int(v) for v in value]
      except ValueError:
        raise ValueError("--%s must be a list of integers, got %r" %
                         (name, ",".join(value))) from None
    values[name] = tuple(value) if isinstance(value, list) else value
  if f.quick:
    return lib.quick_config(**values)
  return lib.GrowthConfig(**values).validate()


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  logging.set_verbosity(logging.INFO)
  cli.import_tensorflow()
  from bench import cost_growth_lib  # pylint: disable=g-import-not-at-top
  try:
    config = make_config(FLAGS, cost_growth_lib)
  except ValueError as e:
    cli.fail(_PROGRAM, e)
  results = cost_growth_lib.run(config, log_fn=logging.info)
  timing.publish(results, cost_growth_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out),
                 cli.resolve_path(FLAGS.markdown_out), logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
