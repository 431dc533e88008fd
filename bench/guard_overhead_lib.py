"""What the non-finite guard costs, measured against what users would use.

Six ways to run a training step (plain `apply_gradients`, the drop-in
`SkipNonFiniteOptimizer`, the trainer's full guarded step, without and with
spike skips, TF's dynamic
loss-scale optimizer and the two-`session.run` NumPy workaround) are built
for one model, each in its own graph and session, and timed round-robin in
one process on the same fixed batch (see `timing`); `run` returns the
results as a JSON-able dict.
"""

import collections
from concurrent import futures
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf

from bench import memory
from bench import run_check_cost
from bench import timing
from tf1_safe_train.core import counters as counters_lib
from tf1_safe_train.core import optimizer as optimizer_lib
from tf1_safe_train import data
from tf1_safe_train import models
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.explain import replay_lib
from tf1_safe_train.trainer.tower import towers
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1

BASELINE = "plain"
CONTROL = "plain_control"
# The six ways to run a step, in the table's order (the timing shuffles).
VARIANTS = ("plain", "skip_nonfinite_optimizer", "guarded_trainer_step",
            "guarded_trainer_step_spikes", "loss_scale_optimizer",
            "two_run_numpy", "skip_replay")
LABELS = {
    "plain": "plain apply_gradients (no protection)",
    "skip_nonfinite_optimizer": "SkipNonFiniteOptimizer",
    "guarded_trainer_step": "trainer's guarded step (towers=1)",
    "guarded_trainer_step_spikes": "the same + --skip_spikes_sigma=6",
    "loss_scale_optimizer": "TF MixedPrecisionLossScaleOptimizer (dynamic)",
    "two_run_numpy": "two session.run + NumPy check",
    # Not a step: what explaining one skip costs (`replay_lib.explain`).
    "skip_replay": "one skip's replay (trainer forensics; not a step)",
    "plain_control": "plain again (A/A control: noise floor)",
}
MOMENTUM = 0.9


@dataclasses.dataclass(frozen=True)
class BenchConfig(object):
  """What `run` measures. Fields mirror `//bench:guard_overhead` flags."""
  models: tuple = ("small_cnn", "resnet20")
  batch_size: int = 128
  warmup_steps: int = 5
  rounds: int = 60
  max_timing_seconds: float = 270.0
  steps_per_block: int = 1
  learning_rate: float = 0.01
  aa_control: bool = True
  memory_probe: bool = True
  memory_probe_only: tuple = ()
  memory_probe_variants: tuple = ()
  memory_probe_steps: int = 3
  memory_probe_workers: int = 2
  seed: int = 0

  def validate(self):
    """Returns self if every field is valid; raises ValueError otherwise."""
    if not self.models:
      raise ValueError("models must not be empty")
    for name in self.models:
      if name not in models.MODEL_NAMES:
        raise ValueError("unknown model %r; expected one of %s" %
                         (name, ", ".join(models.MODEL_NAMES)))
    for name in self.memory_probe_only:
      if name not in self.models:
        raise ValueError("memory_probe_only: %r is not among the measured "
                         "models %s" % (name, ", ".join(self.models)))
    for name in self.memory_probe_variants:
      if name not in VARIANTS:
        raise ValueError("memory_probe_variants: unknown variant %r; "
                         "expected some of %s" % (name, ", ".join(VARIANTS)))
    for name, low in (("batch_size", 1), ("warmup_steps", 0), ("rounds", 1),
                      ("steps_per_block", 1), ("memory_probe_steps", 1),
                      ("memory_probe_workers", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError("%s must be an int >= %d, got %r" % (name, low, value))
    if not self.max_timing_seconds > 0:
      raise ValueError("max_timing_seconds must be > 0, got %r" %
                       (self.max_timing_seconds,))
    if not self.learning_rate > 0:
      raise ValueError("learning_rate must be > 0, got %r" %
                       (self.learning_rate,))
    return self

  def variants(self):
    """The timed variants, in round-robin order."""
    return VARIANTS + ((CONTROL,) if self.aa_control else ())

  def memory_probe_models(self):
    """The models whose variants get a memory probe."""
    if not self.memory_probe:
      return ()
    return tuple(m for m in self.models
                 if not self.memory_probe_only or m in self.memory_probe_only)

  def memory_probe_variant_names(self):
    """The variants that get a memory probe, in the table's order."""
    return tuple(v for v in VARIANTS if not self.memory_probe_variants or
                 v in self.memory_probe_variants)


def quick_config(**overrides):
  """A configuration that checks everything runs, in under a minute.

  Small batch, 3 rounds, no A/A control, memory probed for the first model's
  plain and guarded trainer steps only (a process each): its figures mean
  little. `overrides` are `BenchConfig` fields that win over these.
  """
  quick = dict(batch_size=16, warmup_steps=1, rounds=3, aa_control=False,
               memory_probe_steps=1,
               memory_probe_variants=(BASELINE, "guarded_trainer_step"))
  quick.update(overrides)
  quick.setdefault("memory_probe_only",
                   tuple(quick.get("models", BenchConfig.models))[:1])
  return BenchConfig(**quick).validate()


Variant = collections.namedtuple("Variant",
                                 ["session", "step", "all_steps_applied"])
Variant.__doc__ = """One built variant.

Attributes:
  session: its `tf.compat.v1.Session` (own graph).
  step: callable running one training step.
  all_steps_applied: callable returning True if no step run so far was
    skipped, False if one was, None for the variants that cannot skip.
"""


def fixed_batch(batch_size, seed=0):
  """The first training batch of the synthetic dataset, as NumPy arrays."""
  with tf.Graph().as_default():
    dataset = data.get_dataset("synthetic", "train", batch_size, seed=seed)
    batch = tf1.data.make_one_shot_iterator(dataset).get_next()
    with tf1.Session() as session:
      images, labels = session.run(batch)
  return images, labels.astype(np.int32)


def _fixed_dataset(images, labels):
  # The same in-memory batch every step: no input cost hides the step's.
  return tf.data.Dataset.from_tensors((images, labels)).repeat()


def _input(images, labels):
  with tf.device("/device:CPU:0"), tf1.name_scope("input"):
    iterator = tf1.data.make_one_shot_iterator(_fixed_dataset(images, labels))
    return iterator.get_next()


def _loss(model, images, labels):
  logits = models.get_model(model)(images, is_training=True,
                                   num_classes=data.NUM_CLASSES)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def _momentum(learning_rate):
  return tf1.train.MomentumOptimizer(learning_rate, momentum=MOMENTUM)


def _session_config():
  return towers.session_config(towers.TowerConfig(1, "cpu"))


# Each `_build_*(model, images, labels, learning_rate)` builds one variant in
# the default graph and returns (what one step runs, a bool tensor that is
# True while no step has been skipped, or None if the variant cannot skip).


def _no_skips():
  return tf.equal(counters_lib.skip_counters().skipped_steps, 0)


def _build_plain(model, images, labels, learning_rate):
  """Variant 1: apply_gradients after the moving-statistics updates."""
  loss = _loss(model, *_input(images, labels))
  global_step = tf1.train.get_or_create_global_step()
  opt = _momentum(learning_rate)
  grads_and_vars = opt.compute_gradients(loss, colocate_gradients_with_ops=True)
  with tf1.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = opt.apply_gradients(grads_and_vars, global_step=global_step)
  return train_op, None


def _build_skip_nonfinite(model, images, labels, learning_rate):
  """Variant 2: the drop-in wrapper (moving statistics rolled back)."""
  loss = _loss(model, *_input(images, labels))
  global_step = tf1.train.get_or_create_global_step()
  opt = optimizer_lib.SkipNonFiniteOptimizer(_momentum(learning_rate))
  grads_and_vars = opt.compute_gradients(loss, colocate_gradients_with_ops=True)
  train_op = opt.apply_gradients(grads_and_vars, global_step=global_step)
  return train_op, _no_skips()


def _trainer_step(model, images, labels, learning_rate, **spikes):
  """`train_step.build_step` with one CPU tower: its `Step`."""
  params = params_lib.TrainParams(
      model=model, num_towers=1, device="cpu", batch_size=len(images),
      optimizer="momentum", learning_rate=learning_rate,
      # The other variants' loss is the cross-entropy alone.
      weight_decay=0.0, **spikes).validate()
  graph = train_step.build_step(
      params, local_replication.Local(params, towers.TowerConfig(1, "cpu")),
      dataset_fn=lambda unused_batch_size, unused_seed: _fixed_dataset(
          images, labels))
  return graph


def _build_trainer(model, images, labels, learning_rate, **spikes):
  """Variant 3: `train_step.build_step` with one CPU tower."""
  return _trainer_step(model, images, labels, learning_rate,
                       **spikes).train_op, _no_skips()


def _build_replay(model, images, labels, learning_rate):
  """Row 6: one skip's explanation, as the trainer's forensics hook runs it
  (the stored batch replayed with every float value checked, on the one
  tower: `replay_lib.explain`), timed like a step (the table's ratio is a
  replay's time against a plain step's)."""
  step = _trainer_step(model, images, labels, learning_rate)
  return (step.train_op, step.forensics), None


def _build_trainer_spikes(model, images, labels, learning_rate):
  """Variant 3b: the same with spike skips (a good step's cost: the
  gradient norm and the statistics' update)."""
  return _build_trainer(model, images, labels, learning_rate,
                        skip_spikes_sigma=6.0)


def _build_loss_scale(model, images, labels, learning_rate):
  """Variant 4: TF's MixedPrecisionLossScaleOptimizer, dynamic loss scale."""
  loss = _loss(model, *_input(images, labels))
  global_step = tf1.train.get_or_create_global_step()
  loss_scale = tf1.mixed_precision.DynamicLossScale()
  opt = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer(
      _momentum(learning_rate), loss_scale)
  grads_and_vars = opt.compute_gradients(loss, colocate_gradients_with_ops=True)
  with tf1.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train_op = opt.apply_gradients(grads_and_vars, global_step=global_step)
  # A skip halves the scale, and it grows back only after `increment_period`
  # (2000) good steps: while still at the initial scale, nothing was skipped.
  initial = loss_scale.initial_loss_scale
  return train_op, tf.equal(loss_scale(), initial)


def _build_two_run(model, images, labels, learning_rate):
  """Variant 5: run 1 fetches gradients, NumPy checks, run 2 applies them.

  The moving statistics are updated in run 1 (the forward pass is not run
  twice), so unlike variants 2 and 3 they are not protected on a skip.
  """
  loss = _loss(model, *_input(images, labels))
  global_step = tf1.train.get_or_create_global_step()
  opt = _momentum(learning_rate)
  pairs = [(g, v) for g, v in opt.compute_gradients(
      loss, colocate_gradients_with_ops=True) if g is not None]
  grads = [g for g, _ in pairs]
  fed = [tf1.placeholder(g.dtype, g.shape, name="fed_grad") for g in grads]
  apply_op = opt.apply_gradients([(f, v) for f, (_, v) in zip(fed, pairs)],
                                 global_step=global_step)
  forward = [grads, tf.group(*tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))]
  return (forward, fed, apply_op), None


_BUILDERS = {
    "plain": _build_plain,
    "skip_nonfinite_optimizer": _build_skip_nonfinite,
    "guarded_trainer_step": _build_trainer,
    "guarded_trainer_step_spikes": _build_trainer_spikes,
    "loss_scale_optimizer": _build_loss_scale,
    "two_run_numpy": _build_two_run,
    "skip_replay": _build_replay,
    "plain_control": _build_plain,
}


def build_variant(name, model, images, labels, learning_rate=0.01, seed=0):
  """Builds variant `name` of `model` in a new graph and session.

  Args:
    name: one of `VARIANTS` or `CONTROL`.
    model: a model name.
    images: the fixed batch's images, float32 [batch, 32, 32, 3].
    labels: its int32 labels.
    learning_rate: momentum optimizer's learning rate.
    seed: graph-level random seed.

  Returns:
    A `Variant`, its variables initialised.

  Raises:
    ValueError: for an unknown variant.
  """
  if name not in _BUILDERS:
    raise ValueError("unknown variant %r; expected one of %s" %
                     (name, ", ".join(_BUILDERS)))
  graph = tf.Graph()
  with graph.as_default():
    tf1.set_random_seed(seed)
    built, no_skips = _BUILDERS[name](model, images, labels, learning_rate)
    # Local: the trainer's batch store.
    init = tf.group(tf1.global_variables_initializer(),
                    tf1.local_variables_initializer())
  graph.finalize()
  session = tf1.Session(graph=graph, config=_session_config())
  session.run(init)

  if name == "two_run_numpy":
    forward, fed, apply_op = built
    skips = [0]

    def two_runs():
      values, _ = session.run(forward)
      if all(np.isfinite(v).all() for v in values):
        session.run(apply_op, feed_dict=dict(zip(fed, values)))
      else:
        skips[0] += 1

    return Variant(session, two_runs, lambda: skips[0] == 0)

  if name == "skip_replay":
    train_op, forensics = built
    session.run(train_op)  # Fills the batch store, as a step before a skip.
    batch = forensics.store.read(session, 0)

    def replay():
      replay_lib.explain(session, forensics, 0, batch)

    return Variant(session, replay, lambda: None)

  def step():
    session.run(built)

  if no_skips is None:
    return Variant(session, step, lambda: None)
  return Variant(session, step, lambda: bool(session.run(no_skips)))


def _probe_memory(name, model, batch_size, steps, learning_rate, seed):
  """Builds variant `name` and runs `steps` steps; returns memory in MiB.

  Meant for a fresh process (`probe_main`): TensorFlow's start-up and an
  empty session run first, then the peak-RSS count restarts, so the peak is
  that of building and training this variant alone.

  Args:
    name: the variant.
    model: the model.
    batch_size: examples per step.
    steps: steps to run after building.
    learning_rate: momentum optimizer's learning rate.
    seed: graph-level seed and batch choice.

  Returns:
    dict with `peak_rss_mib` (peak while building and training),
    `start_rss_mib` (resident before building: TensorFlow, the batch, an
    empty session) and `peak_since_start` (False where the count could not
    restart: the peak then includes TensorFlow's start-up).
  """
  images, labels = fixed_batch(batch_size, seed)
  with tf.Graph().as_default():
    with tf1.Session(config=_session_config()) as session:
      session.run(tf.constant(0))
  reset = memory.reset_peak_rss()
  start = memory.current_rss_mib()
  variant = build_variant(name, model, images, labels, learning_rate, seed)
  for _ in range(steps):
    variant.step()
  peak = memory.peak_rss_mib()
  variant.session.close()
  return {"peak_rss_mib": peak, "start_rss_mib": start,
          "peak_since_start": reset}


def probe_main(argv):
  """Entry point of a memory probe process: prints its result as JSON.

  Args:
    argv: one JSON list, the arguments of `_probe_memory`.
  """
  result = _probe_memory(*json.loads(argv[0]))
  sys.stdout.write("\n%s%s\n" % (_PROBE_PREFIX, json.dumps(result)))


_PROBE_PREFIX = "memory_probe="


def _run_probe(args):
  """Runs `probe_main(args)` in a fresh Python process; returns its dict."""
  env = dict(os.environ)
  # The child imports `bench` and `tf1_safe_train` as this process does
  # (from the runfiles tree under `bazel run`, from PYTHONPATH otherwise).
  env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  code = ("import sys; from bench import guard_overhead_lib; "
          "guard_overhead_lib.probe_main(sys.argv[1:])")
  proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)],
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True, check=False)
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(_PROBE_PREFIX):
      return json.loads(line[len(_PROBE_PREFIX):])
  raise RuntimeError("memory probe %s failed (exit %d): %s" % (
      args, proc.returncode, proc.stderr.strip().splitlines()[-1:]))


def probe_memory(config, log_fn=print):
  """Memory of each (model, variant), each measured in its own process.

  Variants share the timing process, whose peak would be everyone's; here
  each is built alone in a new Python process that runs
  `config.memory_probe_steps` steps (see `_probe_memory`).

  Args:
    config: a validated `BenchConfig`.
    log_fn: callable(str) for progress lines.

  Returns:
    dict model -> dict variant -> `_probe_memory` dict.
  """
  jobs = [(m, v) for m in config.memory_probe_models()
          for v in config.memory_probe_variant_names()]
  args = [[v, m, config.batch_size, config.memory_probe_steps,
           config.learning_rate, config.seed] for m, v in jobs]
  log_fn("memory: %d probe processes, %d at a time" %
         (len(jobs), config.memory_probe_workers))
  with futures.ThreadPoolExecutor(config.memory_probe_workers) as pool:
    probes = list(pool.map(_run_probe, args))
  per_model = {m: {} for m in config.memory_probe_models()}
  for (m, v), probe in zip(jobs, probes):
    per_model[m][v] = probe
  return per_model


def measure_model(config, model, log_fn=print):
  """Builds every variant of `model`, times them round-robin, summarises.

  Args:
    config: a validated `BenchConfig`.
    model: a model name.
    log_fn: callable(str) for progress lines.

  Returns:
    A dict variant -> summary (see `timing.summarize`) with `label` and
    `all_steps_applied` added.
  """
  images, labels = fixed_batch(config.batch_size, config.seed)
  built = collections.OrderedDict()
  start = time.time()
  for name in config.variants():
    built[name] = build_variant(name, model, images, labels,
                                config.learning_rate, config.seed)
  log_fn("%s: built %d variants in %.1fs; warm-up %d steps each, then up to "
         "%d rounds of %d step(s) per variant (or %.0fs)" % (
             model, len(built), time.time() - start, config.warmup_steps,
             config.rounds, config.steps_per_block,
             config.max_timing_seconds / len(config.models)))
  every = max(1, config.rounds // 5)

  def progress(r):
    if (r + 1) % every == 0 or r + 1 == config.rounds:
      log_fn("%s: round %d/%d" % (model, r + 1, config.rounds))

  try:
    times = timing.round_robin(
        collections.OrderedDict((n, v.step) for n, v in built.items()),
        config.rounds, config.steps_per_block, config.warmup_steps, progress,
        seed=config.seed,
        max_seconds=config.max_timing_seconds / len(config.models))
    summary = timing.summarize(times, BASELINE, config.steps_per_block)
    for name, variant in built.items():
      summary[name]["label"] = LABELS[name]
      summary[name]["all_steps_applied"] = variant.all_steps_applied()
  finally:
    for variant in built.values():
      variant.session.close()
  log_fn("%s: done in %.0fs" % (model, time.time() - start))
  return summary


def machine_info():
  """What a benchmark's results say of the machine, at the start of a run."""
  return {
      "cpu_count": os.cpu_count(),
      "load_average_start": timing.load_average(),
      "tensorflow": tf.__version__,
      "python": platform.python_version(),
      "control_flow_v2": tf1.control_flow_v2_enabled(),
  }


def run(config, log_fn=print):
  """Measures every model of `config`; returns the JSON-able results.

  Args:
    config: a `BenchConfig` (validated here).
    log_fn: callable(str) for progress lines.

  Returns:
    A dict: `config`, `machine` (CPU count, load averages before and after,
    versions), `baseline`, `models` (model -> variant -> summary, see
    `measure_model`, with the memory probe's fields, None where not probed),
    `run_check` (`run_check_cost.measure`) and `seconds`.
  """
  config.validate()
  start = time.time()
  machine = machine_info()
  results = {"models": {}}
  for model in config.models:
    results["models"][model] = measure_model(config, model, log_fn)
  # Its own row: the first-run check's Python cost per session.run.
  results["run_check"] = run_check_cost.measure(
      rounds=min(config.rounds, 30), runs_per_block=100)
  probes = probe_memory(config, log_fn) if config.memory_probe else {}
  for model, by_variant in results["models"].items():
    for name, summary in by_variant.items():
      probe = probes.get(model, {}).get(name, {})
      summary["peak_rss_mib"] = probe.get("peak_rss_mib")
      summary["start_rss_mib"] = probe.get("start_rss_mib")
      summary["peak_since_start"] = probe.get("peak_since_start")
  machine["load_average_end"] = timing.load_average()
  results.update({
      "benchmark": "guard_overhead",
      "config": dataclasses.asdict(config),
      "machine": machine,
      "baseline": BASELINE,
      "seconds": round(time.time() - start, 1),
  })
  return results


def _fmt_rss(peak, baseline_peak):
  if peak is None:
    return "-"
  if baseline_peak is None:
    return "%.0f" % peak
  return "%.0f (%+.0f)" % (peak, peak - baseline_peak)


def markdown(results):
  """The results as a Markdown table and a legend that says what they mean."""
  header = ["model", "variant", "steps/s (median)", "min–max",
            "× plain [95% CI]", "× plain, CPU time", "peak RSS MiB (Δ plain)"]
  rows = []
  for model, by_variant in results["models"].items():
    baseline_rss = by_variant[results["baseline"]].get("peak_rss_mib")
    for name, s in by_variant.items():
      cpu = s["cpu_ratio_to_baseline"]
      rows.append([
          model, s["label"], "%.2f" % s["steps_per_sec_median"],
          "%.2f–%.2f" % (s["steps_per_sec_min"], s["steps_per_sec_max"]),
          "%.3f [%.3f–%.3f]" % (s["ratio_to_baseline"], s["ratio_ci95"][0],
                                s["ratio_ci95"][1]),
          "-" if cpu is None else "%.3f" % cpu,
          _fmt_rss(s["peak_rss_mib"],
                   None if name == results["baseline"] else baseline_rss),
      ])
  config, machine = results["config"], results["machine"]
  rounds = ", ".join(
      "%s %d" % (model, by_variant[results["baseline"]]["blocks"])
      for model, by_variant in results["models"].items())
  legend = [
      "Batch %d (one fixed synthetic batch, every variant), momentum SGD; "
      "%d warm-up steps per variant, then rounds (%s) of %d step(s) per "
      "variant, in a new order each round, in one process; %d CPUs, load "
      "average %s before and %s after; TF %s; %.0f s in all." % (
          config["batch_size"], config["warmup_steps"], rounds,
          config["steps_per_block"], machine["cpu_count"],
          machine["load_average_start"], machine["load_average_end"],
          machine["tensorflow"], results["seconds"]),
      "× plain: median over rounds of the variant's steps/s divided by plain "
      "apply_gradients' in the same round (1.000 = free), with a bootstrap "
      "95% interval of that median.",
      "× plain, CPU time: the same ratio from the CPU seconds the process "
      "used per step (work rather than waiting, so less disturbed by other "
      "processes).",
  ]
  fewest = min(by_variant[results["baseline"]]["blocks"]
               for by_variant in results["models"].values())
  if fewest < 10:
    legend.insert(0, "**%d rounds are too few for these ratios to mean "
                  "anything**: such a run (--quick) checks that everything "
                  "runs." % fewest)
  if config["aa_control"]:
    legend.append("A/A control: plain timed again as if it were another "
                  "variant; its distance from 1.000 is the noise of this run.")
  starts = [s["start_rss_mib"] for by_variant in results["models"].values()
            for s in by_variant.values() if s.get("start_rss_mib")]
  if starts:
    legend.append(
        "Peak RSS: each variant built alone in a fresh process, peak while "
        "building it and running %d step(s); that process held %.0f MiB "
        "before (TensorFlow, the batch, an empty session)." % (
            config["memory_probe_steps"], statistics.median(starts)))
  text = (timing.markdown_table(header, rows) + "\n\n" +
          "\n".join("- " + line for line in legend))
  if "run_check" in results:
    text += "\n\n" + run_check_cost.markdown(results["run_check"])
  return text
