"""Which finite faults of one tower in four do the skip criteria catch?

Per model (4 towers on virtual CPU devices), one detection run of the
trainer's step with every detection configuration's criterion on in its
dry run, side by side on the same steps (`Detection`: off, the spike
criterion, the tower-agreement criterion; a configuration whose param this
build lacks is reported "not in this build"): a clean stretch (a step a
criterion would skip is its false positive), then one fault every other
step (`--inject_nonfinite` finite kinds, towers taking turns), each
fault's catch by each criterion (the tower-agreement criterion's only if
it names the faulted tower) and how far it moved the applied update (the
averaged gradient with vs without it, both computed in the step:
`drill.CLEAN_GRADIENTS`; every fault is undone after its step, the
criteria's history with it, so each meets a healthy model and a clean
history); what each configuration costs a good step (executed nodes; time
ratio beside an A/A control); and the test precision@1 after a run with
one bit flip per 100 steps (each configuration acting, not dry). `markdown`
makes the docs' tables.
"""

import collections
import dataclasses
import json
import math
import tempfile
import time

import numpy as np
import tensorflow as tf

from bench import executed_ops
from bench import guard_overhead_lib
from bench import timing
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.drills import drill as drill_lib
from tf1_safe_train.trainer.drills import injection
from tf1_safe_train.trainer.run import eval_lib
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.step import train_step
from tf1_safe_train.trainer.tower import towers

tf1 = tf.compat.v1

KINDS = ("bitflip31", "bitflip30", "bitflip27", "bitflip23", "bitflip22",
         "scale2", "scale3", "scale10", "scale100", "stale")


class Detection(collections.namedtuple(
    "Detection", "name overrides reason dry_run_param")):
  """A column: its `TrainParams` overrides, its criterion's reason and the
  param of that criterion's dry run (None: no criterion, "off")."""
  __slots__ = ()


# The columns, off first (the cost baseline).
DETECTIONS = (
    Detection("off", (), None, None),
    Detection("spike", (("skip_spikes_sigma", 6.0),), "spike",
              "spike_dry_run"),
    Detection("tower_outliers", (("skip_tower_outliers", 6.0),),
              "tower_outlier", "skip_tower_outliers_dry_run"),
)
# A fault "matters" when it moves the applied update by more than this.
MOVE_THRESHOLD = 0.1
PRECISION_BITS = (30, 27, 23, 31, 22)
# After the criteria's default warm-up of 100 applied steps.
PRECISION_START = 150
CONTROL = "off (A/A control)"


@dataclasses.dataclass(frozen=True)
class SdcConfig(object):
  """What `run` measures. Fields mirror `//bench:sdc` flags; per-model
  fields are aligned with `models`."""
  models: tuple = ("small_cnn", "resnet20")
  clean_steps: tuple = (2000, 500)
  precision_steps: tuple = (1000, 500)
  num_towers: int = 4
  batch_size: int = 8
  faults_per_kind: int = 100
  kinds: tuple = KINDS
  detections: tuple = DETECTIONS
  cost_rounds: int = 10
  cost_steps_per_block: int = 5
  eval_examples: int = 2000
  seed: int = 0

  def validate(self):
    """Returns self; raises ValueError naming a bad field."""
    for name in ("num_towers", "batch_size", "faults_per_kind", "cost_rounds",
                 "cost_steps_per_block", "eval_examples"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s must be an int >= 1, got %r" % (name, value))
    for name in ("clean_steps", "precision_steps"):
      values = getattr(self, name)
      if len(values) != len(self.models) or min(values) < 1:
        raise ValueError("%s must give each model >= 1 step, got %r" %
                         (name, values))
    if not self.models or not self.kinds or not self.detections:
      raise ValueError("models, kinds and detections must not be empty")
    if self.detections[0].reason is not None:
      raise ValueError("the first detection must be off (the cost baseline)")
    rules = injection.parse_spec(",".join(k + "@0" for k in self.kinds))
    if any(injection.group(r) == "value" for r in rules):
      raise ValueError("kinds must be finite (scaleF, bitflipK, stale)")
    return self


def quick_config():
  """Checks that everything runs (a few minutes): its figures mean little."""
  return SdcConfig(models=("small_cnn",), clean_steps=(100,),
                   precision_steps=(100,), batch_size=2, faults_per_kind=3,
                   cost_rounds=2, cost_steps_per_block=2,
                   eval_examples=100).validate()


def missing_params(overrides):
  """The override names `TrainParams` has no field for (this build's)."""
  fields = {f.name for f in dataclasses.fields(params_lib.TrainParams)}
  return [name for name, _ in overrides if name not in fields]


def fault_spec(config, start):
  """The detection run's drill: from step `start`, one fault every other
  step, kinds in turn, towers taking turns after each round of kinds."""
  kinds, towers_ = len(config.kinds), config.num_towers
  period = 2 * kinds * towers_
  last = start + 2 * kinds * config.faults_per_kind - 1
  items = []
  for k, kind in enumerate(config.kinds):
    for t in range(towers_):
      first = start + 2 * (k + kinds * t)
      if first <= last:
        items.append("%s@%d-%d~%d:%d" % (kind, first, last, period, t))
  return ",".join(items)


def _params(config, m, train_dir, overrides, **more):
  values = dict(
      train_dir=train_dir, model=config.models[m], device="cpu",
      num_towers=config.num_towers, batch_size=config.batch_size,
      seed=config.seed, max_explained_skips=0, max_consecutive_skips=0,
      save_checkpoints_steps=100000, save_summaries_steps=100000,
      log_every_n_steps=100000)
  values.update(overrides)
  values.update(more)
  return params_lib.TrainParams(**values).validate()


def _move(num_towers):
  """|avg(faulted) - avg(clean)| / |avg(clean)| of the towers' gradients
  the drill lists, in float64 (a flipped exponent may square to inf in
  float32)."""
  clean = tf1.get_collection(drill_lib.CLEAN_GRADIENTS)
  faulted = tf1.get_collection(drill_lib.FAULTED_GRADIENTS)
  per_tower = len(clean) // num_towers
  delta, base = [], []
  for k in range(per_tower):
    column = range(k, len(clean), per_tower)
    c = tf.add_n([tf.cast(clean[i], tf.float64) for i in column])
    f = tf.add_n([tf.cast(faulted[i], tf.float64) for i in column])
    delta.append(tf.reduce_sum(tf.square(f - c)))
    base.append(tf.reduce_sum(tf.square(c)))
  return tf.sqrt(tf.add_n(delta) / tf.add_n(base))


def _session(params, spec):
  """(session, step) of the trainer's step of `params` with drill `spec`."""
  params = dataclasses.replace(params, inject_nonfinite=spec)
  graph = tf.Graph()
  with graph.as_default():
    strategy = local_replication.Local(params)
    step = train_step.build_step(params, strategy, replays=False)
    sess = tf1.Session(graph=graph,
                       config=towers.session_config(strategy.tower_config))
    sess.run([tf1.global_variables_initializer(),
              tf1.local_variables_initializer()])
  return sess, step


def _caught(step, detection, tower):
  """Whether `detection`'s criterion (in its dry run) would have skipped
  the step, or with 3 towers or more named `tower` an outlier: a bool
  tensor."""
  fetches = step.reasons.fetches
  values = fetches["values"].get(detection.reason, {})
  if "outlier" in values and int(values["outlier"].shape[0]) >= 3:
    return values["outlier"][tower]
  return fetches["fired"][detection.reason]


def detect(config, m, detections):
  """One detection run of every criterion of `detections` (off left out)
  in its dry run, side by side: per detection, false positives of the
  clean stretch, and per kind the (caught, move) of each fault; every
  fault is undone after its step (model, slots, the criteria's history).
  """
  detections = [d for d in detections if d.reason is not None]
  clean = config.clean_steps[m]
  spec = fault_spec(config, clean)
  rules = injection.parse_spec(spec)
  total = clean + 2 * len(config.kinds) * config.faults_per_kind
  overrides = [o for d in detections for o in d.overrides]
  overrides += [(d.dry_run_param, True) for d in detections]
  with tempfile.TemporaryDirectory() as train_dir:
    sess, step = _session(_params(config, m, train_dir, overrides), spec)
    with sess.graph.as_default():
      move = _move(config.num_towers)
      caught = [[_caught(step, d, t) for d in detections]
                for t in range(config.num_towers)]
      # Model, slots, criteria's history: not the step count (the drill's).
      state = [v for v in tf1.global_variables()
               if v is not tf1.train.get_global_step()]
    false_positives = [0] * len(detections)
    faults = [collections.defaultdict(list) for _ in detections]
    with sess:
      for s in range(total):
        hits = [(t, r) for t in range(config.num_towers)
                for r in injection.active_rules(rules, s, t)]
        if not hits:
          # Any tower named, or the step skipped: caught[t] for each t.
          flags = sess.run([step.train_op, caught])[1]
          for k in range(len(detections)):
            false_positives[k] += (s < clean and
                                   any(f[k] for f in flags))
          continue
        (tower, rule), = hits  # One fault per step, by construction.
        before = sess.run(state)
        _, hit, moved = sess.run([step.train_op, caught[tower], move])
        # Undone: each fault meets the clean model and history, not one a
        # missed 2**16 flip wrecked (which would make every later fault
        # NaN).
        for variable, value in zip(state, before):
          variable.load(value, sess)
        # A non-finite move: the fault made a NaN/Inf (caught by any
        # configuration, off included) or a gradient overflowed float64.
        for k in range(len(detections)):
          faults[k][rule.kind].append((bool(hit[k]), float(moved)))
  return {d.name: {"false_positives": false_positives[k],
                   "clean_steps": clean, "faults": dict(faults[k])}
          for k, d in enumerate(detections)}


def precision(config, m, overrides, root):
  """Test precision@1 after a run with one bit flip per 100 steps (in the
  middle of each hundred after the first, the criteria's warm-up: a flip
  in it is applied whatever the configuration; bits and towers in turn)."""
  steps = config.precision_steps[m]
  spec = ",".join(
      "bitflip%d@%d:%d" % (PRECISION_BITS[i % len(PRECISION_BITS)], s,
                           i % config.num_towers)
      for i, s in enumerate(range(PRECISION_START, steps, 100)))
  train_dir = tempfile.mkdtemp(dir=root)
  params = _params(config, m, train_dir, overrides, max_steps=steps,
                   inject_nonfinite=spec, save_checkpoints_steps=steps)
  summary = train_lib.train(params)
  try:
    evaluation = eval_lib.evaluate(params_lib.EvalParams(
        train_dir=train_dir, model=config.models[m],
        max_examples=config.eval_examples))
  except eval_lib.NonFiniteLossError:
    # A flip it applied wrecked the model (finite weights, NaN loss): the
    # evaluation refuses it; its precision is no better than chance.
    return {"drill": spec, "precision_at_1": None, "wrecked": True,
            "skipped_steps": summary["skipped_steps"]}
  return {"drill": spec, "precision_at_1":
          float(evaluation["precision_at_1"]),
          "skipped_steps": summary["skipped_steps"]}


def good_step_cost(config, m, detections):
  """Per detection configuration (and an A/A copy of the first), executed
  nodes of one good step and its time ratio to the first's."""
  sessions = collections.OrderedDict()
  nodes = {}
  with tempfile.TemporaryDirectory() as train_dir:  # Never written.
    for d in detections:
      sessions[d.name] = _session(_params(config, m, train_dir, d.overrides),
                                  "")
    sessions[CONTROL] = _session(
        _params(config, m, train_dir, detections[0].overrides), "")
  for name, (sess, step) in sessions.items():
    sess.run(step.train_op)  # One-off initialisation runs here.
    nodes[name] = executed_ops.executed_nodes(sess, step.train_op)
  times = timing.round_robin(
      collections.OrderedDict(
          (name, (lambda s=sess, op=step.train_op: s.run(op)))
          for name, (sess, step) in sessions.items()),
      config.cost_rounds, config.cost_steps_per_block, warmup_steps=3,
      seed=config.seed)
  for sess, _ in sessions.values():
    sess.close()
  summary = timing.summarize(times, detections[0].name,
                             config.cost_steps_per_block)
  return {name: {"executed_nodes": nodes[name],
                 "time_ratio": summary[name]["ratio_to_baseline"],
                 "time_ratio_ci95": summary[name]["ratio_ci95"]}
          for name in sessions}


def run(config, log_fn=print):
  """Measures every model and detection configuration; JSON-able results."""
  config.validate()
  start = time.time()
  present = [d for d in config.detections
             if not missing_params(d.overrides)]
  missing = {d.name: missing_params(d.overrides) for d in config.detections
             if missing_params(d.overrides)}
  models = []
  with tempfile.TemporaryDirectory() as root:
    for m, model in enumerate(config.models):
      t0 = time.time()
      # Off catches the non-finite faults only (what every run's non-finite
      # check does): it has no column of its own in the detection run.
      detected = detect(config, m, present)
      # Its results survive an interruption of what follows.
      log_fn("%s detection run: %.0f s %s" % (model, time.time() - t0,
                                              json.dumps(detected)))
      result = {"model": model, "detections": {},
                "detection_seconds": round(time.time() - t0, 1)}
      for d in present:
        t0 = time.time()
        result["detections"][d.name] = dict(
            detected.get(d.name, {}),
            precision=precision(config, m, d.overrides, root),
            seconds=round(time.time() - t0, 1))
        log_fn("%s %s: %.0f s %s" % (model, d.name, time.time() - t0,
                                     _summary(result["detections"][d.name])))
      result["cost"] = good_step_cost(config, m, present)
      models.append(result)
  return {"config": dataclasses.asdict(config), "models": models,
          "not_in_this_build": missing,
          "wall_seconds": round(time.time() - start, 1),
          "machine": guard_overhead_lib.machine_info()}


def _summary(detection):
  """A progress line's figures: a run's results survive its interruption."""
  caught = {k: "%d/%d" % (sum(c for c, _ in f), len(f))
            for k, f in detection.get("faults", {}).items()}
  return "precision %s, false positives %s, caught %s" % (
      _precision(detection["precision"]),
      detection.get("false_positives", "-"), caught or "-")


def _precision(precision_run):
  """"0.903", or "wrecked (NaN loss)" for a model the run wrecked."""
  value = precision_run["precision_at_1"]
  return "wrecked (NaN loss)" if value is None else "%.3f" % value


def _fraction(flags):
  return "%d/%d" % (sum(flags), len(flags)) if flags else "-"


def _matters(move):
  return not math.isfinite(move) or move > MOVE_THRESHOLD


def _detection_rows(model, names):
  """Per fault kind: non-finite faults (caught with detection off), then
  each configuration's catches, overall and among faults that matter."""
  rows = []
  for kind in KINDS + tuple(sorted(set().union(*(
      model["detections"][n]["faults"] for n in names)) - set(KINDS))):
    runs = [model["detections"][n]["faults"].get(kind, []) for n in names]
    if not any(runs):
      continue
    moves = [mv for _, mv in runs[0]]
    row = [model["model"], kind,
           _fraction([not math.isfinite(mv) for mv in moves]),
           _fraction([_matters(mv) for mv in moves]),
           "%.2g" % float(np.median(moves))]
    for faults in runs:
      row += [_fraction([c for c, _ in faults]),
              _fraction([c for c, mv in faults if _matters(mv)])]
    rows.append(row)
  return rows


def _cost_rows(model):
  """Per configuration (and the A/A control): false positives, good-step
  cost, precision."""
  rows = []
  for name in list(model["detections"]) + [CONTROL]:
    d = model["detections"].get(name, {})
    cost = model["cost"][name]
    rows.append([
        model["model"], name,
        "%d/%d" % (d["false_positives"], d["clean_steps"]) if "faults" in d
        else "-", "%d" % cost["executed_nodes"],
        "%.3f [%.3f, %.3f]" % ((cost["time_ratio"],) +
                               tuple(cost["time_ratio_ci95"])),
        _precision(d["precision"]) if d else "-"])
  return rows


def markdown(results):
  """The docs' tables of `run`'s results."""
  models = results["models"]
  names = [n for n, d in (models[0]["detections"].items() if models else ())
           if "faults" in d]
  header = ["model", "fault", "non-finite (caught when off)",
            "move > 10%", "median move (%s run)" % (names[:1] or ["-"])[0]]
  for name in names:
    header += ["%s: caught" % name, "%s: caught, move > 10%%" % name]
  rows = []
  for model in models:
    rows += _detection_rows(model, names) if names else []
  tables = [timing.markdown_table(header, rows)]
  tables.append(timing.markdown_table(
      ["model", "detection", "false positives / clean steps",
       "executed nodes per good step", "good-step time ratio to off [95%]",
       "precision@1, 1 bit flip per 100 steps"],
      [row for model in models for row in _cost_rows(model)]))
  for name, params in sorted(results["not_in_this_build"].items()):
    tables.append("%s: not in this build (no param %s)" %
                  (name, ", ".join(params)))
  return "\n\n".join(tables)
