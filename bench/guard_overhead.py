r"""`//bench:guard_overhead`: what the non-finite guard costs, side by side.

  ./bazelw run //bench:guard_overhead                 # about 5 min on 2 cores
  ./bazelw run //bench:guard_overhead -- --quick      # under a minute
  ./bazelw run //bench:guard_overhead -- --models=resnet20 --rounds=120

Prints a Markdown table (steps/s, ratios to plain `apply_gradients`, peak
RSS) and writes the full results as JSON to --json_out. Flags live here and
only here; `guard_overhead_lib.run(BenchConfig(...))` does the work.
"""

from absl import app
from absl import flags
from absl import logging

from bench import timing
from tf1_safe_train import cli

_PROGRAM = "guard_overhead"
# Same defaults as guard_overhead_lib.BenchConfig (it imports TensorFlow, and
# flags are parsed before TensorFlow starts).
flags.DEFINE_list("models", ["small_cnn", "resnet20"], "Models to measure.")
flags.DEFINE_integer("batch_size", 128, "Examples per step (one fixed batch).")
flags.DEFINE_integer("warmup_steps", 5,
                     "Untimed steps of each variant before timing.")
flags.DEFINE_integer("rounds", 60,
                     "Round-robin rounds; each times one block per variant.")
flags.DEFINE_float("max_timing_seconds", 270.0,
                   "Stop the rounds early once they have taken this long "
                   "(shared by the models; at least 3 rounds each).")
flags.DEFINE_integer("steps_per_block", 1, "Steps per timed block.")
flags.DEFINE_float("learning_rate", 0.01, "Momentum optimizer's rate.")
flags.DEFINE_boolean("aa_control", True,
                     "Also time a second copy of the baseline: its ratio "
                     "shows the measurement's noise.")
flags.DEFINE_boolean("memory_probe", True,
                     "Measure each variant's peak RSS in a fresh process.")
flags.DEFINE_list("memory_probe_only", [],
                  "Probe memory only for these models (default: all).")
flags.DEFINE_list("memory_probe_variants", [],
                  "Probe memory only for these variants (default: all).")
flags.DEFINE_integer("memory_probe_steps", 3,
                     "Steps each memory probe runs after building.")
flags.DEFINE_integer("memory_probe_workers", 2,
                     "Memory probe processes run at a time.")
flags.DEFINE_integer("seed", 0, "Graph-level seed and batch choice.")
flags.DEFINE_boolean("quick", False,
                     "Small batch, 3 rounds, no A/A control, memory of "
                     "small_cnn's plain and guarded trainer steps only: "
                     "checks that everything runs (< 1 min); flags given "
                     "explicitly still win.")
flags.DEFINE_string("json_out", "/tmp/guard_overhead.json",
                    "Where to write the results as JSON ('' = nowhere).")
flags.DEFINE_string("markdown_out", "",
                    "Also write the Markdown table here ('' = nowhere).")

FLAGS = flags.FLAGS
_CONFIG_FLAGS = ("models", "batch_size", "warmup_steps", "rounds",
                 "max_timing_seconds", "steps_per_block", "learning_rate",
                 "aa_control", "memory_probe", "memory_probe_only",
                 "memory_probe_variants", "memory_probe_steps",
                 "memory_probe_workers", "seed")


def make_config(f, lib):
  """Turns parsed flags into a validated `BenchConfig`.

  Args:
    f: the parsed `flags.FLAGS`.
    lib: the `guard_overhead_lib` module.

  Returns:
    A validated `lib.BenchConfig`.

  Raises:
    ValueError: for a bad value.
  """
  values = {}
  for name in _CONFIG_FLAGS:
    if f.quick and not f[name].present:
      continue  # The quick preset's value.
    value = f[name].value
    values[name] = tuple(value) if isinstance(value, list) else value
  if f.quick:
    return lib.quick_config(**values)
  return lib.BenchConfig(**values).validate()


def main(argv):
  if len(argv) > 1:
    cli.fail(_PROGRAM, "unexpected arguments: %s" % " ".join(argv[1:]))
  logging.set_verbosity(logging.INFO)
  cli.import_tensorflow()
  from bench import guard_overhead_lib  # pylint: disable=g-import-not-at-top
  try:
    config = make_config(FLAGS, guard_overhead_lib)
  except ValueError as e:
    cli.fail(_PROGRAM, e)
  results = guard_overhead_lib.run(config, log_fn=logging.info)
  timing.publish(results, guard_overhead_lib.markdown(results),
                 cli.resolve_path(FLAGS.json_out),
                 cli.resolve_path(FLAGS.markdown_out), logging.info)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROGRAM))
