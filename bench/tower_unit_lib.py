"""What does --skip_unit=tower buy with one flaky tower in four?

Short trainings of the trainer on synthetic data, one tower of four
poisoned with probability p per step (`--inject_nonfinite=nan%p:3`), with
`--skip_unit=step`, `--skip_unit=tower`, and `tower` with
`--quarantine_after=2`: examples applied (deterministic for a seed), per
second of wall and CPU time (noisy on a shared machine), test precision@1;
and the executed nodes of one good step in each mode (deterministic: what
the tower unit adds per step; with quarantine, of the step rebuilt without
the flaky tower). `markdown` makes the
docs' table.
"""

import dataclasses
import os
import tempfile
import time

import tensorflow as tf

from bench import executed_ops
from bench import guard_overhead_lib
from bench import timing
from tf1_safe_train.trainer.run import eval_lib
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

UNITS = ("step", "tower", "tower+quarantine")
QUARANTINE_AFTER = 2


@dataclasses.dataclass(frozen=True)
class TowerUnitConfig(object):
  """What `run` measures. Fields mirror `//bench:tower_unit` flags."""
  max_steps: int = 300
  batch_size: int = 16
  num_towers: int = 4
  flaky_tower: int = 3
  probability: float = 0.05
  seed: int = 0
  eval_examples: int = 2000

  def validate(self):
    """Returns self; raises ValueError naming a bad field."""
    for name in ("max_steps", "batch_size", "num_towers", "eval_examples"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s must be an int >= 1, got %r" % (name, value))
    if not 0 <= self.flaky_tower < self.num_towers:
      raise ValueError("flaky_tower must be in [0, num_towers), got %r" %
                       (self.flaky_tower,))
    if not 0 <= self.probability <= 1:
      raise ValueError("probability must be in [0, 1], got %r" %
                       (self.probability,))
    return self

  def drill(self):
    return "nan%%%g:%d" % (self.probability, self.flaky_tower)


def quick_config():
  """Checks that everything runs (about a minute): its figures mean little."""
  return TowerUnitConfig(max_steps=20, batch_size=4, probability=0.3,
                         eval_examples=100).validate()


def _params(config, unit, train_dir):
  return params_lib.TrainParams(
      train_dir=train_dir, num_towers=config.num_towers, device="cpu",
      batch_size=config.batch_size, max_steps=config.max_steps,
      seed=config.seed, inject_nonfinite=config.drill(),
      skip_unit=unit.split("+")[0],
      quarantine_after=QUARANTINE_AFTER if "quarantine" in unit else 0,
      # Training throughput only: no replays (but quarantine's, at most
      # QUARANTINE_AFTER for the flaky tower).
      max_explained_skips=0, max_consecutive_skips=0,
      save_checkpoints_steps=config.max_steps,
      save_summaries_steps=config.max_steps,
      log_every_n_steps=config.max_steps).validate()


def _one_run(config, unit, root):
  train_dir = tempfile.mkdtemp(dir=root)
  params = _params(config, unit, train_dir)
  wall, cpu = time.time(), _cpu_seconds()
  summary = train_lib.train(params)
  wall, cpu = time.time() - wall, _cpu_seconds() - cpu
  rejected = sum(summary.get("rejected_by_tower", []))
  # After a quarantine the last segment (steps_this_run, no skips here)
  # applied one tower fewer per step.
  applied = (summary["applied_steps"] * config.num_towers - rejected -
             len(summary.get("quarantined_towers", ())) *
             summary["steps_this_run"]) * config.batch_size
  evaluation = eval_lib.evaluate(params_lib.EvalParams(
      train_dir=train_dir, max_examples=config.eval_examples))
  return {"unit": unit, "applied_steps": summary["applied_steps"],
          "skipped_steps": summary["skipped_steps"],
          "rejected_towers": rejected, "examples_applied": applied,
          "examples_applied_per_wall_sec": round(applied / wall, 1),
          "examples_applied_per_cpu_sec": round(applied / cpu, 1),
          "precision_at_1": float(evaluation["precision_at_1"]),
          "nodes_per_good_step": good_step_nodes(config, unit)}


def _cpu_seconds():
  times = os.times()
  return times.user + times.system


def good_step_nodes(config, unit):
  """Executed nodes of one good step (no drill) of the trainer's step."""
  with tempfile.TemporaryDirectory() as train_dir:
    params = dataclasses.replace(_params(config, unit, train_dir),
                                 inject_nonfinite="")
    with tf.Graph().as_default():
      strategy = local_replication.Local(params)
      step = train_step.build_step(
          params, strategy, quarantined=(config.flaky_tower,)
          if params.quarantine_after else ())
      config_proto = towers.session_config(strategy.tower_config)
      with tf1.Session(config=config_proto) as sess:
        sess.run([tf1.global_variables_initializer(),
                  tf1.local_variables_initializer()])
        sess.run(step.train_op)  # One-off initialisation runs here.
        return executed_ops.executed_nodes(sess, step.train_op)


def run(config, log_fn=print):
  """Runs each unit once; returns JSON-able results."""
  config.validate()
  start = time.time()
  runs = []
  with tempfile.TemporaryDirectory() as root:
    for unit in UNITS:
      runs.append(_one_run(config, unit, root))
      log_fn("--skip_unit=%s: %s" % (unit, runs[-1]))
  return {"config": dataclasses.asdict(config), "drill": config.drill(),
          "runs": runs, "wall_seconds": round(time.time() - start, 1),
          "machine": guard_overhead_lib.machine_info()}


def markdown(results):
  """The docs' table of `run`'s results."""
  base = results["runs"][0]["nodes_per_good_step"]
  rows = [[r["unit"], str(r["applied_steps"]), str(r["skipped_steps"]),
           str(r["rejected_towers"]), str(r["examples_applied"]),
           "%.0f" % r["examples_applied_per_wall_sec"],
           "%.0f" % r["examples_applied_per_cpu_sec"],
           "%.3f" % r["precision_at_1"],
           "%d (%+d)" % (r["nodes_per_good_step"],
                         r["nodes_per_good_step"] - base)]
          for r in results["runs"]]
  return timing.markdown_table(
      ["--skip_unit", "applied steps", "skipped steps", "towers left out",
       "examples applied", "per wall s", "per CPU s", "precision@1",
       "executed nodes per good step"], rows)
