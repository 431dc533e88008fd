"""Trainer throughput against the number of towers, and the input alone.

The trainer's full step (`train_step.build_step`, its own synthetic
input pipeline included) is built once per tower count on virtual CPU
devices, next to the input pipeline alone, each in its own graph and session;
all are timed round-robin in blocks (see `timing`) and reported in examples/s.
"""

import collections
import dataclasses
import os
import platform
import time

import tensorflow as tf

from bench import timing
from tf1_safe_train import data
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

INPUT_ONLY = "input_only"


@dataclasses.dataclass(frozen=True)
class TowersConfig(object):
  """What `run` measures. Fields mirror `//bench:towers` flags."""
  model: str = "resnet20"
  batch_size: int = 32
  num_towers: tuple = (1, 2, 4)
  warmup_steps: int = 5
  rounds: int = 5
  steps_per_block: int = 10
  seed: int = 0

  def validate(self):
    """Returns self if every field is valid; raises ValueError otherwise."""
    params_lib.TrainParams(model=self.model,
                           batch_size=self.batch_size).validate()
    if not self.num_towers:
      raise ValueError("num_towers must not be empty")
    for name, values, low in (
        ("num_towers", self.num_towers, 1),
        ("warmup_steps", (self.warmup_steps,), 0),
        ("rounds", (self.rounds,), 1),
        ("steps_per_block", (self.steps_per_block,), 1)):
      for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
          raise ValueError("%s must be ints >= %d, got %r" % (name, low, value))
    if len(set(self.num_towers)) != len(self.num_towers):
      raise ValueError("num_towers has duplicates: %r" % (self.num_towers,))
    return self


Built = collections.namedtuple("Built", ["session", "step",
                                         "examples_per_step"])


def _name(num_towers):
  return "towers_%d" % num_towers


def build_trainer(model, num_towers, batch_size, seed=0):
  """The trainer's step with `num_towers` CPU towers, its input included.

  Args:
    model: a model name.
    num_towers: towers, each on its own virtual CPU device.
    batch_size: examples per tower per step.
    seed: graph-level seed.

  Returns:
    A `Built`.
  """
  params = params_lib.TrainParams(
      model=model, num_towers=num_towers, device="cpu",
      batch_size=batch_size, seed=seed).validate()
  config = towers.TowerConfig(num_towers, "cpu")
  graph = tf.Graph()
  with graph.as_default():
    tf1.set_random_seed(seed)
    train_op = train_step.build_step(
        params, local_replication.Local(params, config)).train_op
    init = tf1.global_variables_initializer()
  graph.finalize()
  session = tf1.Session(graph=graph, config=towers.session_config(config))
  session.run(init)
  return Built(session, lambda: session.run(train_op),
               batch_size * num_towers)


def build_input(batch_size, batches_per_step, seed=0, make_once=False):
  """The trainer's input pipeline alone (no model), as the trainer builds it.

  Args:
    batch_size: examples per batch.
    batches_per_step: batches one `step` pulls (one `session.run` each).
    seed: shuffle seed.
    make_once: the synthetic examples made once into a table (the
      trainer's input for a run that reads an epoch: `tower_input`).

  Returns:
    A `Built`.
  """
  graph = tf.Graph()
  with graph.as_default(), tf.device("/device:CPU:0"):
    dataset = data.get_dataset("synthetic", "train", batch_size, seed=seed,
                               with_ids=True, make_once=make_once)
    batch = tf1.data.make_one_shot_iterator(dataset).get_next()
  graph.finalize()
  session = tf1.Session(graph=graph)

  def step():
    for _ in range(batches_per_step):
      session.run(batch)

  return Built(session, step, batch_size * batches_per_step)


def run(config, log_fn=print):
  """Times every tower count and the input alone; returns JSON-able results.

  Args:
    config: a `TowersConfig` (validated here).
    log_fn: callable(str) for progress lines.

  Returns:
    A dict: `config`, `machine`, and `results`: name (`towers_<n>`,
    `input_only`) -> `examples_per_sec_median`, `_min`, `_max`,
    `ratio_to_first` (paired median ratio to the first tower count) and
    `examples_per_step`.
  """
  config.validate()
  start = time.time()
  load_start = timing.load_average()
  built = collections.OrderedDict()
  for n in config.num_towers:
    built[_name(n)] = build_trainer(config.model, n, config.batch_size,
                                    config.seed)
  # As many batches per step as the widest trainer pulls, so a block drains
  # far more than the pipeline prefetches while the others run. Made once,
  # as the trainers' (their default max_steps read an epoch: `tower_input`).
  built[INPUT_ONLY] = build_input(config.batch_size, max(config.num_towers),
                                  config.seed, make_once=True)
  log_fn("towers: built %s in %.1fs" % (", ".join(built), time.time() - start))
  try:
    times = timing.round_robin(
        collections.OrderedDict((k, b.step) for k, b in built.items()),
        config.rounds, config.steps_per_block, config.warmup_steps,
        lambda r: log_fn("towers: round %d/%d" % (r + 1, config.rounds)),
        seed=config.seed)
  finally:
    for b in built.values():
      b.session.close()
  first = _name(config.num_towers[0])
  summary = timing.summarize(times, first, config.steps_per_block)
  results = collections.OrderedDict()
  for name, s in summary.items():
    per_step = built[name].examples_per_step
    results[name] = {
        "examples_per_sec_median": s["steps_per_sec_median"] * per_step,
        "examples_per_sec_min": s["steps_per_sec_min"] * per_step,
        "examples_per_sec_max": s["steps_per_sec_max"] * per_step,
        # Steps/s ratio, made an examples/s ratio.
        "ratio_to_first": (s["ratio_to_baseline"] * per_step /
                           built[first].examples_per_step),
        "examples_per_step": per_step,
    }
  return {
      "benchmark": "towers",
      "config": dataclasses.asdict(config),
      "machine": {"cpu_count": os.cpu_count(),
                  "load_average_start": load_start,
                  "load_average_end": timing.load_average(),
                  "tensorflow": tf.__version__,
                  "python": platform.python_version()},
      "results": results,
      "seconds": round(time.time() - start, 1),
  }


def markdown(results):
  """The results as a Markdown table with a one-line legend."""
  header = ["what", "examples/s (median)", "min–max", "× 1st row"]
  rows = []
  for name, r in results["results"].items():
    what = ("input pipeline alone (no training)" if name == INPUT_ONLY else
            "trainer, %s tower(s)" % name.split("_")[1])
    rows.append([what, "%.0f" % r["examples_per_sec_median"],
                 "%.0f–%.0f" % (r["examples_per_sec_min"],
                                r["examples_per_sec_max"]),
                 "%.2f" % r["ratio_to_first"]])
  config, machine = results["config"], results["machine"]
  legend = ("%s, %d examples per tower per step, synthetic data; %d rounds x "
            "%d steps after %d warm-up steps; %d CPUs (towers are virtual CPU "
            "devices sharing them); load average %s before, %s after." % (
                config["model"], config["batch_size"], config["rounds"],
                config["steps_per_block"], config["warmup_steps"],
                machine["cpu_count"], machine["load_average_start"],
                machine["load_average_end"]))
  return timing.markdown_table(header, rows) + "\n\n" + legend
