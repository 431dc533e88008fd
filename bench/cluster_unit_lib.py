"""What does --skip_unit=worker buy with one flaky worker in three?

Short sync trainings of `//:train` on a loopback cluster (1 ps, 3
workers, synthetic data), worker 1's gradients poisoned with probability p
per step (`--inject_nonfinite=nan%p:0/1`), with the unit off
(`--skip_unit=step`: a poisoned push skips the step for everybody), on
(`--skip_unit=worker`: it is left out, the others' average applied), and
on with `--quarantine_after=2` (after two faults that do not reproduce,
worker 1 pushes nothing for good): applied steps, worker pushes left out,
examples applied (deterministic for a seed but for turns: a worker ahead
may push twice into a step), and per second of the chief's run (noisy on a
shared machine). `markdown` makes the docs' table. `quick_config` runs the
quarantine's cluster only.
"""

import dataclasses
import io
import json
import os
import sys
import tempfile
import time

from bench import timing
from tf1_safe_train.cluster import local_cluster_lib
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.run import run_summary

MODES = ("off", "on", "on+quarantine")
QUARANTINE_AFTER = 2


@dataclasses.dataclass(frozen=True)
class ClusterUnitConfig(object):
  """What `run` measures. Fields mirror `//bench:cluster_unit` flags."""
  max_steps: int = 200
  batch_size: int = 16
  num_workers: int = 3
  flaky_worker: int = 1
  probability: float = 0.05
  seed: int = 0
  modes: tuple = MODES  # Which runs (some of MODES), in this order.

  def validate(self):
    """Returns self; raises ValueError naming a bad field."""
    for name in ("max_steps", "batch_size", "num_workers"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s must be an int >= 1, got %r" % (name, value))
    # Worker 0 is the chief, which is never quarantined.
    if not 1 <= self.flaky_worker < self.num_workers:
      raise ValueError("flaky_worker must be in [1, num_workers), got %r" %
                       (self.flaky_worker,))
    if not 0 <= self.probability <= 1:
      raise ValueError("probability must be in [0, 1], got %r" %
                       (self.probability,))
    if not self.modes or any(m not in MODES for m in self.modes):
      raise ValueError("modes must be some of %s, got %r" %
                       (", ".join(MODES), self.modes))
    return self

  def drill(self):
    return "nan%%%g:0/%d" % (self.probability, self.flaky_worker)


def quick_config():
  """Checks that everything runs: its figures mean little.

  One cluster, the quarantine's: its run passes through every part of
  `run` (the flags, the summary, the records that date the quarantine,
  the table). The other modes differ only by flags (`train_flags`), whose
  runs the cluster tests make (tests/cluster/worker_unit_cluster_test.py,
  the unit; tests/e2e/distributed_test.py, sync without it): two more
  clusters of 3 workers would cost the test 35 s more for nothing new.
  """
  return ClusterUnitConfig(max_steps=12, batch_size=4, probability=0.3,
                           modes=("on+quarantine",)).validate()


def train_flags(config, mode, train_dir):
  """The workers' flags of one run."""
  return [
      "--train_dir=" + train_dir, "--device=cpu", "--num_towers=1",
      "--sync_replicas", "--batch_size=%d" % config.batch_size,
      "--max_steps=%d" % config.max_steps, "--seed=%d" % config.seed,
      "--inject_nonfinite=" + config.drill(),
      "--skip_unit=" + ("step" if mode == "off" else "worker"),
      # A floor of 1: a worker ahead may take a slower one's turn, and a
      # step of two pushes of the flaky worker is then still decided.
      *(["--min_healthy_workers=1"] if mode != "off" else []),
      *(["--quarantine_after=%d" % QUARANTINE_AFTER]
        if "quarantine" in mode else []),
      # Training throughput only: no replays (but the quarantine's, at
      # most QUARANTINE_AFTER), no give-up.
      "--max_explained_skips=0", "--max_consecutive_skips=0",
      "--save_checkpoints_steps=%d" % config.max_steps,
      "--save_summaries_steps=%d" % config.max_steps,
      "--log_every_n_steps=%d" % config.max_steps]


def local_cluster(flags, num_workers):
  """Runs 1 ps + `num_workers` workers of //:train (`//:local_cluster`'s
  launcher, this interpreter); raises RuntimeError if it fails."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  out = io.StringIO()
  with tempfile.NamedTemporaryFile(suffix=".log") as noise:
    launcher = local_cluster_lib.LocalCluster(
        1, num_workers,
        lambda unused_task: [sys.executable, "-m", "tf1_safe_train.train"],
        flags, env=env, out=out, err=out, noise_log=noise.name)
    code = launcher.run()
  if code:
    raise RuntimeError("the cluster exited with %d:\n%s" % (
        code, out.getvalue()[-3000:]))


def _one_run(config, mode, root, launch):
  train_dir = tempfile.mkdtemp(dir=root)
  wall = time.time()
  launch(train_flags(config, mode, train_dir), config.num_workers)
  wall = time.time() - wall
  with open(os.path.join(train_dir, run_summary.RUN_SUMMARY)) as f:
    summary = json.load(f)
  left_out = sum(summary.get("rejected_by_worker", []))
  idle = 0
  if summary.get("quarantined_workers"):
    # Its pushes after the decision (its last fault's step) are idle:
    # one a step, as a rule (see the module doc: turns).
    records = skip_log.read(skip_log.path(train_dir, config.flaky_worker))
    idle = summary["global_step"] - 1 - max(r["step"] for r in records)
  pushes = summary["applied_steps"] * config.num_workers - left_out - idle
  applied = pushes * config.batch_size
  return {"mode": mode, "applied_steps": summary["applied_steps"],
          "skipped_steps": summary["skipped_steps"],
          "pushes_left_out": left_out, "idle_pushes": idle,
          "quarantined_workers": summary.get("quarantined_workers", []),
          "examples_applied": applied,
          "chief_seconds": summary["wall_seconds"],
          "examples_applied_per_sec": round(
              applied / summary["wall_seconds"], 1),
          "cluster_wall_seconds": round(wall, 1)}


def run(config, log_fn=print, launch=local_cluster):
  """Runs each mode once; returns JSON-able results.

  Args:
    config: a `ClusterUnitConfig`.
    log_fn: called with one line per run.
    launch: `launch(train_flags, num_workers)` runs a cluster to its end
      (default: `local_cluster`; a test's: its loopback fixture).
  """
  config.validate()
  start = time.time()
  load = timing.load_average()
  runs = []
  with tempfile.TemporaryDirectory() as root:
    for mode in config.modes:
      runs.append(_one_run(config, mode, root, launch))
      log_fn("worker unit %s: %s" % (mode, runs[-1]))
  return {"config": dataclasses.asdict(config), "drill": config.drill(),
          "runs": runs, "wall_seconds": round(time.time() - start, 1),
          "load_average_start": load, "load_average_end":
          timing.load_average(), "cpu_count": os.cpu_count()}


def markdown(results):
  """The docs' table of `run`'s results."""
  rows = [[r["mode"], str(r["applied_steps"]), str(r["skipped_steps"]),
           str(r["pushes_left_out"]), str(r["idle_pushes"]),
           str(r["examples_applied"]), "%.1f" % r["examples_applied_per_sec"]]
          for r in results["runs"]]
  return timing.markdown_table(
      ["worker unit", "applied steps", "skipped steps", "pushes left out",
       "idle pushes (quarantined)", "examples applied",
       "per second of the chief's run"], rows)
