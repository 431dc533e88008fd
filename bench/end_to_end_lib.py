"""`//:train` as a user runs it against the loop they would run instead.

`train_lib.train` runs to its end (MonitoredTrainingSession, its hooks,
summaries, checkpoints, the forensics store, its `tf.data` input with
example ids); a hook of the run (`_Driver`) times it in blocks of steps and,
between blocks, times the same number of steps of each side variant in a
random order: the reference loop (`reference_loop`, replicated), a second
copy of it (the A/A control: how far two identical loops differ here), the
reference with its variables on the CPU (`parameter_server`: what placement
costs), the trainer's step alone in a plain session (`train_step.build_step`,
one `session.run`: what the runner costs beyond it) and the trainer's input
pipeline alone (what making the input costs). The breakdown puts each part
of `//:train`'s step as a ratio to the reference's step: from wall time,
from the process's CPU time and, for the graph's parts, from step stats
(op time and nodes executed in one traced step).
"""

import collections
import dataclasses
import json
import os
import platform
import re
import shutil
import tempfile
import time

import numpy as np
import tensorflow as tf

from bench import executed_ops
from bench import reference_loop
from bench import timing
from bench import towers_lib
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.inputs import tower_input
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1

TRAIN = "train"
REFERENCE = "reference"
REFERENCE_AA = "reference_aa"
REFERENCE_PS = "reference_ps"
STEP = "step"
INPUT = "input"
SIDE_VARIANTS = (REFERENCE, REFERENCE_AA, REFERENCE_PS, STEP, INPUT)

# Graph parts of the trainer's step, by the name scopes of their nodes
# (first match wins; the rest is the model and its optimizer).
_PARTS = collections.OrderedDict([
    ("forensics store", ("batch_store/", "last_applied_batch/",
                         "/store_batch", "keep_applied_batch")),
    ("input (iterator, ids)", ("input/", "/batch/", "IteratorGetNext")),
    ("guard (checks, decision, counters)",
     ("guarded_step", "nonfinite", "step_state", "counters", "skip",
      "train_op", "applied_update", "any_nonfinite", "IsFinite")),
    ("summaries", ("summar",)),
])


_LABEL_OP_TYPE = re.compile(r" = (\w+)\(")
_APPLY_OPS = ("ResourceApply", "Apply", "ResourceSparseApply")


@dataclasses.dataclass(frozen=True)
class EndToEndConfig(object):
  """What `run` measures. Fields mirror `//bench:end_to_end` flags."""
  models: tuple = ("small_cnn", "resnet20")
  num_towers: tuple = (1, 2, 4)
  batch_size: int = 32
  warmup_steps: int = 10
  rounds: int = 8
  steps_per_block: int = 25
  seed: int = 0

  def validate(self):
    """Returns self if every field is valid; raises ValueError otherwise."""
    if not self.models:
      raise ValueError("models must not be empty")
    for model in self.models:
      params_lib.TrainParams(model=model,
                             batch_size=self.batch_size).validate()
    if not self.num_towers:
      raise ValueError("num_towers must not be empty")
    for name, values, low in (
        ("num_towers", self.num_towers, 1),
        ("warmup_steps", (self.warmup_steps,), 1),
        ("rounds", (self.rounds,), 1),
        ("steps_per_block", (self.steps_per_block,), 1)):
      for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
          raise ValueError("%s must be ints >= %d, got %r" % (name, low, value))
    return self


class _TimedHook(tf1.train.SessionRunHook):
  """Runs `hook`, adding its before_run + after_run seconds to `seconds`."""

  def __init__(self, hook, seconds, timing_on):
    self._hook, self._seconds, self._on = hook, seconds, timing_on
    self.name = type(hook).__name__

  def begin(self):
    self._hook.begin()

  def after_create_session(self, session, coord):
    self._hook.after_create_session(session, coord)

  def before_run(self, run_context):
    start = time.perf_counter()
    args = self._hook.before_run(run_context)
    self._add(start)
    return args

  def after_run(self, run_context, run_values):
    start = time.perf_counter()
    self._hook.after_run(run_context, run_values)
    self._add(start)

  def end(self, session):
    # A checkpoint saver's end is the run's last save (a whole save, the
    # meta graph as cached: what each periodic save costs).
    start = time.perf_counter()
    self._hook.end(session)
    self._seconds[self.name + ".end"] += time.perf_counter() - start

  def _add(self, start):
    if self._on():
      self._seconds[self.name] += time.perf_counter() - start


class _TimedLocal(local_replication.Local):
  """`Local` whose session is MonitoredTrainingSession's, hook for hook
  (the chief's: first hooks, summary saver, checkpoint saver, hooks), each
  hook timed."""

  def __init__(self, params, seconds, timing_on):
    super().__init__(params)
    self._seconds, self._on = seconds, timing_on

  def session(self, scaffold, hooks, stopped_by_signal, first_hooks=()):
    del stopped_by_signal
    params = self.params
    savers = [tf1.train.SummarySaverHook(
        save_steps=params.save_summaries_steps, output_dir=params.train_dir,
        scaffold=scaffold), tf1.train.CheckpointSaverHook(
            params.train_dir, save_steps=params.save_checkpoints_steps,
            scaffold=scaffold)]
    hooks = list(first_hooks) + savers + list(hooks)
    # The driver (last) times whole blocks; it is not a hook of the trainer.
    timed = [_TimedHook(h, self._seconds, self._on) for h in hooks[:-1]]
    return tf1.train.MonitoredSession(
        session_creator=tf1.train.ChiefSessionCreator(
            scaffold=scaffold, checkpoint_dir=params.train_dir,
            master=self.master, config=towers.session_config(
                self.tower_config)),
        hooks=timed + hooks[-1:])


class _Driver(tf1.train.SessionRunHook):
  """Times `//:train` in blocks; between blocks, a block of each side
  variant, in a random order (see the module doc)."""

  def __init__(self, side, config):
    self._side, self._config = side, config
    self._rng = np.random.default_rng(config.seed)
    self.times = {name: ([], []) for name in [TRAIN] + list(side)}
    self.timing = False
    self._steps, self._start = 0, None

  def after_create_session(self, session, coord):
    for step in self._side.values():
      for _ in range(self._config.warmup_steps):
        step()

  def after_run(self, run_context, run_values):
    config = self._config
    self._steps += 1
    if self._steps < config.warmup_steps:
      return
    if self._start is None:  # The end of the warm-up: the first block.
      self._begin_block()
      return
    if (self._steps - config.warmup_steps) % config.steps_per_block == 0:
      self._record(TRAIN, self._start)
      for i in self._rng.permutation(len(self._side)):
        name = list(self._side)[i]
        start = (time.perf_counter(), time.process_time())
        for _ in range(config.steps_per_block):
          self._side[name]()
        self._record(name, start)
      if len(self.times[TRAIN][0]) == config.rounds:
        self.timing = False
        run_context.request_stop()
        return
      self._begin_block()

  def _begin_block(self):
    self.timing = True
    self._start = (time.perf_counter(), time.process_time())

  def _record(self, name, start):
    wall, cpu = self.times[name]
    wall.append(time.perf_counter() - start[0])
    cpu.append(time.process_time() - start[1])


def _build_side(model, num_towers, config):
  """name -> (session, one-step callable, fetches to trace or None)."""
  side = collections.OrderedDict()
  for name, update in ((REFERENCE, reference_loop.REPLICATED),
                       (REFERENCE_AA, reference_loop.REPLICATED),
                       (REFERENCE_PS, reference_loop.PARAMETER_SERVER)):
    ref = reference_loop.build(model, num_towers, config.batch_size, update,
                               seed=config.seed)
    side[name] = (ref.session,
                  lambda ref=ref: ref.session.run(ref.fetches), ref.fetches)
  step = towers_lib.build_trainer(model, num_towers, config.batch_size,
                                  config.seed)
  side[STEP] = (step.session, step.step,
                step.session.graph.get_operation_by_name("train_op"))
  # As the trainer reads it (a default run reads an epoch or more).
  source = towers_lib.build_input(
      config.batch_size, num_towers, config.seed,
      make_once=tower_input.reads_an_epoch(_train_params(
          model, num_towers, config, "unused")))
  side[INPUT] = (source.session, source.step, None)
  return side


def _trace(session, fetches, parts=True):
  """(op seconds per part, nodes per part) of one traced step (without
  `parts`, every node is "model and optimizer": a reference's)."""
  metadata = executed_ops.trace_run(session, fetches)
  seconds = collections.Counter()
  nodes = collections.Counter()
  for device in metadata.step_stats.dev_stats:
    for node in device.node_stats:
      match = _LABEL_OP_TYPE.search(node.timeline_label)
      part = "model and optimizer"
      # The optimizer's own update runs inside the guard's apply branch.
      if parts and not (match and match.group(1).startswith(_APPLY_OPS)):
        part = next((p for p, marks in _PARTS.items()
                     if any(m in node.node_name for m in marks)), part)
      seconds[part] += node.all_end_rel_micros * 1e-6
      nodes[part] += 1
  return seconds, nodes


def _traces(side, repeats=3):
  """Median op seconds and nodes per part of each traced side variant."""
  traces = {}
  for name, (session, _, fetches) in side.items():
    if fetches is None:
      continue
    runs = [_trace(session, fetches, parts=name == STEP)
            for _ in range(repeats)]
    parts = set().union(*[s for s, _ in runs])
    traces[name] = {
        "op_seconds": {p: float(np.median([s[p] for s, _ in runs]))
                       for p in parts},
        "nodes": dict(runs[-1][1])}
  return traces


def _train_params(model, num_towers, config, train_dir):
  """`//:train`'s defaults but the model, towers, batch and seed; the
  run stops when timed (`_Driver`), before its max_steps (its default, or
  more if the timing needs them)."""
  return params_lib.TrainParams(
      model=model, num_towers=num_towers, device="cpu",
      batch_size=config.batch_size, seed=config.seed, train_dir=train_dir,
      max_steps=max(params_lib.TrainParams().max_steps,
                    config.warmup_steps + config.rounds *
                    config.steps_per_block + 1)).validate()


def measure(model, num_towers, config, log_fn=print):
  """One model and tower count: timing summary, hook seconds, traces."""
  side = _build_side(model, num_towers, config)
  driver = _Driver(collections.OrderedDict(
      (name, step) for name, (_, step, _) in side.items()), config)
  hook_seconds = collections.Counter()
  train_dir = tempfile.mkdtemp(prefix="end_to_end_")
  try:
    params = _train_params(model, num_towers, config, train_dir)
    strategy = _TimedLocal(params, hook_seconds, lambda: driver.timing)
    train_lib.train(params, extra_hooks=[driver], strategy=strategy)
    traces = _traces(side)
  finally:
    shutil.rmtree(train_dir, ignore_errors=True)
    for session, _, _ in side.values():
      session.close()
  times = {name: timing.BlockTimes(*t) for name, t in driver.times.items()}
  summary = timing.summarize(times, REFERENCE, config.steps_per_block)
  steps = len(driver.times[TRAIN][0]) * config.steps_per_block
  result = {"timing": summary, "traces": traces,
          "hook_seconds_per_step": {k: v / steps
                                    for k, v in hook_seconds.items()
                                    if not k.endswith(".end")},
          "checkpoint_save_seconds": hook_seconds[
              "CheckpointSaverHook.end"],
          "save_checkpoints_steps": params.save_checkpoints_steps,
          "examples_per_step": config.batch_size * num_towers}
  log_fn("end_to_end: %s, %d tower(s): %s" % (model, num_towers, json.dumps(
      {k: v for k, v in result.items() if k != "timing"})))
  log_fn("end_to_end: %s, %d tower(s): ratios to the reference (wall, CPU): "
         "%s" % (model, num_towers, ", ".join(
             "%s %.3f %.3f" % (name, s["ratio_to_baseline"],
                               s["cpu_ratio_to_baseline"])
             for name, s in summary.items())))
  return result


def run(config, log_fn=print):
  """Measures every model and tower count; returns JSON-able results."""
  config.validate()
  start = time.time()
  load_start = timing.load_average()
  results = collections.OrderedDict()
  for model in config.models:
    for n in config.num_towers:
      results["%s/%d" % (model, n)] = measure(model, n, config, log_fn)
  return {
      "benchmark": "end_to_end",
      "config": dataclasses.asdict(config),
      "machine": {"cpu_count": os.cpu_count(),
                  "load_average_start": load_start,
                  "load_average_end": timing.load_average(),
                  "tensorflow": tf.__version__,
                  "python": platform.python_version()},
      "results": results,
      "seconds": round(time.time() - start, 1),
  }


def _ratio_text(s, key="ratio_to_baseline"):
  low, high = s["ratio_ci95"]
  return "%.2f (%.2f–%.2f)" % (s[key], low, high)


def _median_seconds(s, which):
  return float(np.median(s["block_%s_seconds" % which]))


def _extra(s, key):
  """A variant's extra time per step over the reference's, as a fraction of
  it, from the paired median ratio (throughput) `key`."""
  return 1.0 / s[key] - 1.0


def _graph_parts(ops):
  """The step graph's parts from step stats: part -> (op time, nodes), each
  as a fraction of the reference's step."""
  ref_ops = sum(ops[REFERENCE]["op_seconds"].values())
  ref_nodes = sum(ops[REFERENCE]["nodes"].values())
  step_ops, step_nodes = ops[STEP]["op_seconds"], ops[STEP]["nodes"]
  parts = collections.OrderedDict()
  for part in _PARTS:
    parts["step graph: " + part] = (step_ops.get(part, 0.0) / ref_ops,
                                    step_nodes.get(part, 0) / ref_nodes)
  model = "model and optimizer"
  parts["step graph: model and optimizer (step − reference_ps)"] = (
      (step_ops.get(model, 0.0) -
       sum(ops[REFERENCE_PS]["op_seconds"].values())) / ref_ops,
      (step_nodes.get(model, 0) -
       sum(ops[REFERENCE_PS]["nodes"].values())) / ref_nodes)
  return parts, ref_nodes


def breakdown(result, steps_per_block):
  """Each part of `//:train`'s step as a fraction of the reference's step:
  an ordered dict part -> (wall, CPU, op time, nodes executed), each a
  fraction or None (not measured that way)."""
  t, ops = result["timing"], result["traces"]
  graph, ref_nodes = _graph_parts(ops)
  wall, cpu = "ratio_to_baseline", "cpu_ratio_to_baseline"
  parts = collections.OrderedDict()
  parts["variable placement (reference_ps − reference)"] = (
      _extra(t[REFERENCE_PS], wall), _extra(t[REFERENCE_PS], cpu), None,
      sum(ops[REFERENCE_PS]["nodes"].values()) / ref_nodes - 1.0)
  for part, (op_time, nodes) in graph.items():
    parts[part] = (None, None, op_time, nodes)
  parts["input pipeline threads (its CPU, alone)"] = (
      None, _median_seconds(t[INPUT], "cpu") /
      _median_seconds(t[REFERENCE], "cpu"), None, None)
  parts["runner: train − step (hooks, savers, MonitoredSession)"] = (
      _extra(t[TRAIN], wall) - _extra(t[STEP], wall),
      _extra(t[TRAIN], cpu) - _extra(t[STEP], cpu), None, None)
  ref_wall = _median_seconds(t[REFERENCE], "wall") / steps_per_block
  hooks = result["hook_seconds_per_step"]
  for hook, seconds in sorted(hooks.items(), key=lambda kv: -kv[1])[:6]:
    parts["  hook " + hook] = (seconds / ref_wall, None, None, None)
  parts["  a checkpoint's save ÷ save_checkpoints_steps"] = (
      result["checkpoint_save_seconds"] / result["save_checkpoints_steps"] /
      ref_wall, None, None, None)
  parts["all: train − reference"] = (_extra(t[TRAIN], wall),
                                     _extra(t[TRAIN], cpu), None, None)
  return parts


def markdown(results):
  """The side-by-side table, then each configuration's breakdown."""
  header = ["model / towers", "reference ex/s", "//:train ex/s",
            "train ÷ ref (wall, 95% CI)", "train ÷ ref (CPU)",
            "A/A (wall, 95% CI)", "A/A (CPU)", "step alone ÷ ref"]
  rows = []
  for name, r in results["results"].items():
    t, per = r["timing"], r["examples_per_step"]
    rows.append([name, "%.0f" % (t[REFERENCE]["steps_per_sec_median"] * per),
                 "%.0f" % (t[TRAIN]["steps_per_sec_median"] * per),
                 _ratio_text(t[TRAIN]),
                 "%.2f" % t[TRAIN]["cpu_ratio_to_baseline"],
                 _ratio_text(t[REFERENCE_AA]),
                 "%.2f" % t[REFERENCE_AA]["cpu_ratio_to_baseline"],
                 "%.2f" % t[STEP]["ratio_to_baseline"]])
  out = [timing.markdown_table(header, rows)]
  config = results["config"]
  fmt = lambda x: "-" if x is None else "%+.3f" % x
  for name, r in results["results"].items():
    parts = breakdown(r, config["steps_per_block"])
    out.append("Breakdown %s (fraction of the reference's step):\n\n" % name +
               timing.markdown_table(
                   ["part", "wall", "CPU", "op time", "nodes executed"],
                   [[p] + [fmt(x) for x in values]
                    for p, values in parts.items()]))
  machine = results["machine"]
  out.append(
      "%d examples per tower per step, synthetic data; %d rounds x %d steps "
      "after %d warm-up steps; %d CPUs (towers are virtual CPU devices "
      "sharing them); load average %s before, %s after; %.0f s." % (
          config["batch_size"], config["rounds"], config["steps_per_block"],
          config["warmup_steps"], machine["cpu_count"],
          machine["load_average_start"], machine["load_average_end"],
          results["seconds"]))
  return "\n\n".join(out)
