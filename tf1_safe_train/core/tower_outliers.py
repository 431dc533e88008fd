"""Tower outliers: a tower whose gradient norm disagrees with the others'.

Every tower computes a gradient of the same model on a batch of the same
distribution; a finite fault of one tower (a flipped exponent bit, a wrong
accumulation) shows as its norm's log-ratio to the median of the *other*
towers (with 3 towers, to the nearest other one) straying from that
ratio's own running history, by more than K of its running standard
deviations and by at least a minimum factor. With 3
or more towers the outlier is named and (`--skip_unit=tower`) left out of
the average like a NaN tower, or its step skipped; with 2 the ratio
log(n0/n1) is watched and a step whose towers disagree is skipped (which
of the two is wrong cannot be told). A skip criterion (`criteria.Criterion`,
reason "tower_outlier"), declared in `tower_outliers_spec`.
"""

import math

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import criteria
from tf1_safe_train.core import norms
from tf1_safe_train.core import tower_outliers_spec

tf1 = tf.compat.v1

REASON = tower_outliers_spec.REASON
TowerOutlierConfig = tower_outliers_spec.TowerOutlierConfig
# The per-tower count (checkpointed history: `trainer/recovery/state_rules`).
BY_TOWER = "tower_outlier_by_tower"
# Context.towers' keys this criterion reads: each tower's global gradient
# norm (a tensor or a function building it), device (Python strings) and
# index (Python ints; default 0..; the others are quarantined).
NORM, DEVICE, INDEX = "grad_norm", "device", "index"


def tower_norms(tower_grads):
  """A function building each tower's global gradient norm (float32 [n];
  each on its tower's device, over the tensors of its fused non-finite
  check: `norms.fused_global_norm`), for `Context.towers[NORM]`: built
  only if a criterion reads it.

  Args:
    tower_grads: one list of gradients per tower.
  """
  tower_grads = [list(g) for g in tower_grads]
  return lambda: tf.stack([norms.fused_global_norm(g) for g in tower_grads])


def _others_reference(x):
  """[n]: for each i, what x[i] is compared with among the other towers
  (n >= 3): their median with 4 towers or more; with 3, the other tower
  nearest to x[i]. (The median of two is their mean, which one bad tower
  drags along: a healthy tower's distance to it would stray as much as the
  bad one's. A healthy tower's nearest other is the other healthy one; the
  bad tower's nearest is still a healthy one.)"""
  n = int(x.shape[0])
  others = np.array([[j for j in range(n) if j != i] for i in range(n)])
  gathered = tf.gather(x, others)
  if n == 3:
    nearest = tf.argmin(tf.abs(gathered - x[:, None]), axis=1)
    return tf.gather(gathered, nearest, axis=1, batch_dims=1)
  middle = sorted({(n - 2) // 2, (n - 1) // 2})
  # Sorted ascending by top_k of the negated (one sort for every tower).
  ranked = -tf.math.top_k(-gathered, k=n - 1, sorted=True).values
  return tf.reduce_mean(tf.gather(ranked, middle, axis=1), axis=1)


class TowerOutliers(criteria.Criterion):
  """The tower-agreement criterion of a step's decision.

  `judge` builds the towers' verdicts from their norms (once per step; the
  trainer's tower unit calls it before averaging, to leave an outlier out);
  `decide` then says whether the step is skipped for it: with `leave_out`
  only when the towers disagree and none can be named (2 towers).
  """

  reason = REASON

  def __init__(self, config):
    self.config = TowerOutlierConfig.of(config)
    self.dry_run = self.config.dry_run
    self.leave_out = False  # Set by a step that leaves outliers out.
    self._judged = None  # The step's verdicts (`judge`), built once.
    self._state = None
    # The judged towers' indices and devices, for the reports' words.
    self._indices, self._devices = [], []

  def _variables_for(self, num_towers):
    """The state (made once, at the graph's root): applied steps seen, the
    running mean and variance of each slot's log-ratio, the per-tower
    count."""
    if self._state is None:
      with tf1.init_scope(), tf1.get_default_graph().name_scope(None):
        with tf1.name_scope("tower_outlier_stats"):
          make = criteria.state_variable
          self._state = dict(
              count=make("applied", tf.constant(0, tf.int64)),
              mean=make("log_ratio_mean", tf.zeros([num_towers])),
              var=make("log_ratio_var", tf.zeros([num_towers])))
        self._state["by_tower"] = make(
            BY_TOWER, tf.zeros([num_towers], tf.int64))
    return self._state

  @property
  def variables(self):
    return list(self._state.values()) if self._state else []

  @property
  def by_tower(self):
    """The int64 [num_towers] count of each tower's outlier steps."""
    return self._state["by_tower"]

  def judge(self, norms, devices=None, indices=None, num_towers=None):
    """Builds the step's verdicts (before the decision); returns the bool
    [len(norms)] flags of the towers named outliers (all False with 2).

    Args:
      norms: float32 [n] tensor, each built tower's global gradient norm.
      devices: their devices (for the line), or None.
      indices: their tower indices (default 0..n-1).
      num_towers: every tower, built or not (default n).
    """
    if self._judged is not None:
      return self._judged["outliers"]
    n = int(norms.shape[0])
    if n < 2:
      raise ValueError("skip_tower_outliers compares towers: the step has "
                       "%d" % n)
    indices = list(indices if indices is not None else range(n))
    self._devices = list(devices or [""] * n)
    self._indices = indices
    state = self._variables_for(num_towers or n)
    config = self.config
    with tf1.name_scope("tower_outliers"):
      x = tf.math.log(norms)
      # A NaN/Inf or zero norm is no statistic: the step is not judged.
      valid = tf.reduce_all(tf.math.is_finite(x))
      if n >= 3:
        slots, r = indices, x - _others_reference(x)
      else:
        slots, r = indices[:1], x[:1] - x[1:]
      mean = tf.gather(state["mean"].read_value(), slots)
      sd = tf.sqrt(tf.gather(state["var"].read_value(), slots))
      d = tf.abs(r - mean)
      warm = state["count"].read_value() >= config.warmup_steps
      stray = tf.logical_and(d > config.sigma * sd,
                             d >= math.log(config.min_factor))
      flags = tf.logical_and(tf.logical_and(warm, valid), stray,
                             name="outliers")
    self._judged = dict(
        slots=slots, r=r, valid=valid, flags=flags,
        outliers=flags if n >= 3 else tf.zeros([n], tf.bool),
        values={"outlier": flags, "ratio": tf.exp(r), "usual": tf.exp(mean),
                "sigmas": d / sd, "grad_norm": norms})
    return self._judged["outliers"]

  def decide(self, context):
    """(flag, values): the flag True to skip the step (any outlier; with
    `leave_out`, only 2 towers that disagree).

    Raises:
      ValueError: if the step has no per-tower norms (the wrapper was given
        no `tower_grads_and_vars=`).
    """
    if self._judged is None:
      towers = context.towers
      if NORM not in towers:
        raise ValueError(
            "skip_tower_outliers needs each tower's gradients (the "
            "wrapper's apply_gradients(tower_grads_and_vars=...))")
      norms = towers[NORM]
      norms = norms() if callable(norms) else norms
      self.judge(norms, towers.get(DEVICE), towers.get(INDEX))
    judged = self._judged
    fired = judged["flags"]
    if self.leave_out and len(judged["slots"]) > 1:
      fired = tf.constant(False)
    flag = tf.logical_and(tf.reduce_any(fired),
                          tf.logical_not(context.nonfinite),
                          name="tower_outlier")
    return flag, dict(judged["values"])

  def _fold(self):
    """Ops folding the step's log-ratios in (not an outlier's; a dry
    run's, which change nothing, all)."""
    state, judged = self._state, self._judged
    slots = tf.constant(np.array(judged["slots"])[:, None])
    count = state["count"].read_value() + 1
    rate = tf.maximum(1.0 / tf.cast(count, tf.float32),
                      1.0 - self.config.decay)
    mean = tf.gather(state["mean"].read_value(), judged["slots"])
    var = tf.gather(state["var"].read_value(), judged["slots"])
    delta = judged["r"] - mean
    keep = (judged["valid"] if self.dry_run else
            tf.logical_and(judged["valid"], tf.logical_not(judged["flags"])))
    new_mean = tf.where(keep, mean + rate * delta, mean)
    new_var = tf.where(keep, (1.0 - rate) * (var + rate * delta * delta), var)
    return [tf1.scatter_nd_update(state["mean"], slots, new_mean),
            tf1.scatter_nd_update(state["var"], slots, new_var),
            tf1.assign(state["count"], tf.where(judged["valid"], count,
                                                count - 1))]

  def _count(self):
    """Op counting each named outlier tower (not in a dry run)."""
    if self.dry_run or len(self._judged["slots"]) < 2:
      return []
    slots = tf.constant(np.array(self._judged["slots"])[:, None])
    return [tf1.scatter_nd_add(self._state["by_tower"], slots,
                               tf.cast(self._judged["flags"], tf.int64))]

  def on_apply(self, context):
    return tf.group(*(self._fold() + self._count()),
                    name="tower_outliers_on_apply")

  def on_skip(self, context):
    return tf.group(*self._count(), name="tower_outliers_on_skip")

  def _tower(self, position):
    index = self._indices[position]
    device = self._devices[position]
    return "tower %d (%s)" % (index, device) if device else "tower %d" % index

  def tower_words(self, values, position):
    """Why the tower at `position` is an outlier, from fetched values."""
    return ("gradient norm %.4gx the other towers' median (usually %.4gx): "
            "%.4g sigma > %g, min factor %g" % (
                values["ratio"][position], values["usual"][position],
                values["sigmas"][position], self.config.sigma,
                self.config.min_factor))

  def outlier_towers(self, values):
    """The indices of the towers named outliers (none with 2 towers)."""
    if self._judged is None or len(self._indices) == 2:
      return []
    return [self._indices[p]
            for p in np.flatnonzero(np.reshape(values["outlier"], [-1]))]

  def outlier_words(self, values):
    """{tower index: `tower_words`} of the towers named outliers."""
    return {t: self.tower_words(values, self._indices.index(t))
            for t in self.outlier_towers(values)}

  def describe(self, values):
    """"tower 2 (/device:CPU:2): gradient norm 10.1x the other towers'
    median (usually 1x): 48 sigma > 6, min factor 3", or for 2 towers
    "towers 0 (...) and 1 (...) disagree: ...; which one cannot be told"."""
    flags = np.reshape(values["outlier"], [-1])
    if len(self._indices) == 2:
      return ("%s and %s disagree: gradient norm ratio %.4g (usually %.4g): "
              "%.4g sigma > %g, min factor %g; with 2 towers which one is "
              "wrong cannot be told" % (
                  self._tower(0), self._tower(1), values["ratio"][0],
                  values["usual"][0], values["sigmas"][0], self.config.sigma,
                  self.config.min_factor))
    return "; ".join("%s: %s" % (self._tower(p), self.tower_words(values, p))
                     for p in np.flatnonzero(flags)) or "-"

  def record(self, values):
    """The skips.jsonl fields: the outlier towers (indices, devices) and
    each tower's values."""
    named = self.outlier_towers(values)
    fields = {k: [float(v) for v in np.reshape(values[k], [-1])]
              for k in ("ratio", "usual", "sigmas", "grad_norm")}
    return dict(fields, towers=[int(t) for t in named],
                devices=[self._devices[self._indices.index(t)]
                         for t in named],
                sigma=self.config.sigma, min_factor=self.config.min_factor)
