"""Does --skip_spikes_sigma save a run from finite gradient spikes?

Short trainings of the trainer on synthetic data, over a few seeds: the
undisturbed run, and for each drill (`--inject_nonfinite=scaleF@N:T`, a
tower's gradients multiplied by F at chosen steps) the run without and with
the option. Each run is then evaluated on the test split; `markdown` makes
the docs' table (test loss and precision@1 as mean and seed-to-seed range).
"""

import dataclasses
import math
import statistics
import tempfile
import time

from bench import guard_overhead_lib
from bench import timing
from tf1_safe_train.trainer.run import eval_lib
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_lib


@dataclasses.dataclass(frozen=True)
class SpikesConfig(object):
  """What `run` measures. Fields mirror `//bench:spikes` flags."""
  seeds: tuple = (0, 1, 2)
  max_steps: int = 300
  batch_size: int = 32
  num_towers: int = 2
  # Spikes after the warm-up, in tower 1, then in tower 0.
  drill_steps: tuple = (150, 220)
  scales: tuple = ("1e3", "1e6")
  sigma: float = 6.0
  warmup_steps: int = 100
  eval_examples: int = 2000

  def validate(self):
    """Returns self; raises ValueError naming a bad field."""
    for name in ("max_steps", "batch_size", "num_towers", "warmup_steps",
                 "eval_examples"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s must be an int >= 1, got %r" % (name, value))
    if not self.seeds or not self.scales:
      raise ValueError("seeds and scales must not be empty")
    if any(not 0 <= s < self.max_steps for s in self.drill_steps):
      raise ValueError("drill_steps must be in [0, max_steps), got %r" %
                       (self.drill_steps,))
    return self

  def drill(self, scale):
    """The --inject_nonfinite spec of `scale`: one spike per drill step,
    towers taking turns."""
    return ",".join("scale%s@%d:%d" % (scale, step, i % self.num_towers)
                    for i, step in enumerate(self.drill_steps))


def quick_config():
  """Checks that everything runs (about a minute): its figures mean little."""
  return SpikesConfig(seeds=(0,), max_steps=40, batch_size=8,
                      drill_steps=(30,), scales=("1e4",), warmup_steps=20,
                      eval_examples=200).validate()


def _cases(config):
  yield "undisturbed", "", 0.0
  for scale in config.scales:
    for sigma in (0.0, config.sigma):
      yield "scale%s" % scale, config.drill(scale), sigma


def _one_run(config, drill, sigma, seed, root):
  train_dir = tempfile.mkdtemp(dir=root)
  params = params_lib.TrainParams(
      train_dir=train_dir, num_towers=config.num_towers, device="cpu",
      batch_size=config.batch_size, max_steps=config.max_steps, seed=seed,
      inject_nonfinite=drill, skip_spikes_sigma=sigma,
      spike_warmup_steps=config.warmup_steps,
      save_checkpoints_steps=config.max_steps,
      save_summaries_steps=config.max_steps,
      log_every_n_steps=config.max_steps).validate()
  summary = train_lib.train(params)
  evaluation = eval_lib.evaluate(params_lib.EvalParams(
      train_dir=train_dir, max_examples=config.eval_examples))
  return {"seed": seed, "final_train_loss": summary["final_loss"],
          "test_loss": float(evaluation["loss"]),
          "precision_at_1": float(evaluation["precision_at_1"]),
          "spike_skips": summary["spike_skips"],
          "nonfinite_skips": summary["nonfinite_skips"],
          "exit_reason": summary["exit_reason"]}


def run(config, log_fn=print):
  """Runs every case over every seed; returns JSON-able results."""
  config.validate()
  start = time.time()
  cases = []
  with tempfile.TemporaryDirectory() as root:
    for name, drill, sigma in _cases(config):
      runs = []
      for seed in config.seeds:
        runs.append(_one_run(config, drill, sigma, seed, root))
        log_fn("%s sigma=%g seed=%d: %s" % (name, sigma, seed, runs[-1]))
      cases.append({"drill": drill, "name": name, "sigma": sigma,
                    "runs": runs})
  return {"config": dataclasses.asdict(config), "cases": cases,
          "wall_seconds": round(time.time() - start, 1),
          "machine": guard_overhead_lib.machine_info()}


def _spread(values, fmt):
  """Mean (min–max) of the finite values, and how many were not finite."""
  finite = [v for v in values if math.isfinite(v)]
  text = "-"
  if len(finite) == 1:
    text = fmt % finite[0]
  elif finite:
    text = (fmt + " (" + fmt + "–" + fmt + ")") % (
        statistics.mean(finite), min(finite), max(finite))
  if len(finite) < len(values):
    text += " +%d NaN" % (len(values) - len(finite))
  return text


def markdown(results):
  """The docs' table of `run`'s results."""
  rows = []
  for case in results["cases"]:
    runs = case["runs"]
    rows.append([
        case["name"], "%g" % case["sigma"] if case["sigma"] else "off",
        _spread([r["test_loss"] for r in runs], "%.3g"),
        _spread([r["precision_at_1"] for r in runs], "%.3f"),
        "/".join(str(r["spike_skips"]) for r in runs),
        # An applied spike can overflow later steps into NaN: skipped, and
        # after --max_consecutive_skips the run gives up.
        "/".join(str(r["nonfinite_skips"]) for r in runs)])
  return timing.markdown_table(
      ["drill", "--skip_spikes_sigma", "test loss, mean (range over seeds)",
       "precision@1", "spike skips per seed", "non-finite skips per seed"],
      rows)
