"""Tower outliers: a tower whose gradient is too large for its batch.

Every tower computes a gradient of the same model on a batch of the same
distribution; a finite fault of one tower (a flipped exponent bit, a wrong
accumulation) makes its gradient norm larger than its batch explains. What
a batch explains: the norm of the loss's gradient at the model's output
(for softmax cross-entropy the batch's |softmax - one-hot| over its size:
how wrong the model is on it), times the others' gradient norm per unit of
that, plus the gradient every tower shares (the weight decay's, which no
batch moves). Without the output's norms (a wrapper's towers, unless
given) a tower's norm is compared with the others' alone, which at small
batches spreads by orders of magnitude (docs/performance.md).

A tower is an outlier when the log of its norm over that expectation
(with 3 towers, from the nearer other tower; with 4 or more, the others'
median) exceeds its own running history by more than K of its running
standard deviations and by at least a minimum factor. Only a gradient too
large is an outlier: one too small holds back at most its tower's share
of the average, and batches the model already fits make many. The history
is of the part above the others' (the upper half, where outliers would
be). With 3 or more towers the outlier is named and (`--skip_unit=tower`)
left out of the average like a NaN tower, or its step skipped; with 2 the
two towers' disagreement either way is watched and a step where they
disagree is skipped (which of the two is wrong cannot be told). A skip
criterion (`criteria.Criterion`, reason "tower_outlier"), declared in
`tower_outliers_spec`.
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
# index (Python ints; default 0..; the others are quarantined); optional:
# each tower's norm of its loss's gradient at the model's output
# (`output_grad_norm`) and the norm of the gradient every tower shares
# (`shared_grad_norm`, e.g. the weight decay's), what a batch's norm is
# expected from.
NORM, DEVICE, INDEX = "grad_norm", "device", "index"
OUTPUT_NORM, SHARED_NORM = "output_grad_norm", "shared_grad_norm"


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


def output_grad_norm(loss, logits):
  """The norm of `loss`'s gradient at the model's output `logits`, what a
  tower's batch explains of its gradient norm (`Context.towers[
  OUTPUT_NORM]`): for a mean softmax cross-entropy, |softmax - one-hot|
  over the batch size. Its gradient op reuses the loss's (the cross-
  entropy's backprop output): a few nodes."""
  grad, = tf.gradients(loss, [logits])
  return tf.norm(tf.cast(grad, tf.float32))


def _others_reference(x):
  """[n]: for each i, what x[i] is compared with among the other towers:
  their median with 4 towers or more; with 3, the other tower nearest to
  x[i]; with 2, the other one. (The median of two is their mean, which one
  bad tower drags along: a healthy tower's distance to it would stray as
  much as the bad one's. A healthy tower's nearest other is the other
  healthy one; the bad tower's nearest is still a healthy one.)"""
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


def log_excess(norms, output=None, shared=None):
  """[n]: the log of each tower's gradient norm over the norm its batch
  explains, from the other towers (see the module's doc): with `output`
  (each tower's `output_grad_norm`), the others' gradient norm per unit of
  output norm times its own, with the `shared` gradient's norm (scalar or
  per tower; the part no batch moves) added in quadrature; without, the
  others' norm. In float64 (a finite float32 norm squares beyond float32).
  `log_excess_np` is its NumPy twin (the replay's)."""
  norms = tf.cast(norms, tf.float64)
  if output is None:
    x = tf.math.log(norms)
    return x - _others_reference(x)
  shared2 = (tf.square(tf.cast(shared, tf.float64)) if shared is not None
             else tf.constant(0.0, tf.float64))
  output = tf.cast(output, tf.float64)
  # A tower's own part: its norm without the shared gradient's.
  own = tf.sqrt(tf.maximum(tf.square(norms) - shared2,
                           np.finfo(np.float64).tiny))
  # The others' own norm per unit of output norm (`_others_reference`).
  per_unit = tf.exp(_others_reference(tf.math.log(own / output)))
  expected = tf.sqrt(tf.square(per_unit * output) + shared2)
  return tf.math.log(norms) - tf.math.log(expected)


def _others_reference_np(x):
  """`_others_reference`'s NumPy twin."""
  x = np.asarray(x, np.float64)
  n = len(x)
  out = np.empty(n)
  for i in range(n):
    others = np.delete(x, i)
    out[i] = (others[np.argmin(np.abs(others - x[i]))] if n == 3
              else np.median(others))
  return out


def log_excess_np(norms, output=None, shared=None):
  """`log_excess`'s NumPy twin (an outlier's replay judges with it)."""
  norms = np.asarray(norms, np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    if output is None:
      x = np.log(norms)
      return x - _others_reference_np(x)
    shared2 = np.square(np.asarray(shared if shared is not None else 0.0,
                                   np.float64))
    output = np.asarray(output, np.float64)
    own = np.sqrt(np.maximum(np.square(norms) - shared2,
                             np.finfo(np.float64).tiny))
    per_unit = np.exp(_others_reference_np(np.log(own / output)))
    return np.log(norms) - np.log(np.sqrt(np.square(per_unit * output) +
                                          shared2))


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
    self._explained = False  # Whether each batch's output norm was read.

  def _variables_for(self, num_towers):
    """The state (made once, at the graph's root): applied steps seen, the
    running mean and variance of each slot's excess, the per-tower count.
    (Not the names of the statistics of log-ratios of norms alone, before
    the output's norms: a checkpoint of those warms up afresh.)"""
    if self._state is None:
      with tf1.init_scope(), tf1.get_default_graph().name_scope(None):
        with tf1.name_scope("tower_outlier_history"):
          make = criteria.state_variable
          self._state = dict(
              count=make("applied", tf.constant(0, tf.int64)),
              mean=make("excess_mean", tf.zeros([num_towers])),
              var=make("excess_var", tf.zeros([num_towers])))
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

  def judge(self, norms, devices=None, indices=None, num_towers=None,
            output=None, shared=None):
    """Builds the step's verdicts (before the decision); returns the bool
    [len(norms)] flags of the towers named outliers (all False with 2).

    Args:
      norms: float32 [n] tensor, each built tower's global gradient norm.
      devices: their devices (for the line), or None.
      indices: their tower indices (default 0..n-1).
      num_towers: every tower, built or not (default n).
      output: optional float32 [n], each tower's `output_grad_norm`.
      shared: optional float32 scalar or [n], the shared gradient's norm.
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
    self._explained = output is not None
    state = self._variables_for(num_towers or n)
    config = self.config
    with tf1.name_scope("tower_outliers"):
      r = tf.cast(log_excess(norms, output, shared), tf.float32)
      # A NaN/Inf or zero norm is no statistic: the step is not judged.
      valid = tf.reduce_all(tf.math.is_finite(r))
      if n >= 3:  # Too large only: the upper half is its history.
        slots, excess = indices, tf.maximum(r, 0.0)
      else:  # One of the two too large, either: log(n0 / n1)'s size.
        slots, r = indices[:1], r[:1]
        excess = tf.abs(r)
      mean = tf.gather(state["mean"].read_value(), slots)
      sd = tf.sqrt(tf.gather(state["var"].read_value(), slots))
      d = excess - mean
      warm = state["count"].read_value() >= config.warmup_steps
      stray = tf.logical_and(d > config.sigma * sd,
                             d >= math.log(config.min_factor))
      flags = tf.logical_and(tf.logical_and(warm, valid), stray,
                             name="outliers")
    self._judged = dict(
        slots=slots, excess=excess, valid=valid, flags=flags,
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
      built = {k: v() if callable(v) else v for k, v in towers.items()
               if k in (NORM, OUTPUT_NORM, SHARED_NORM)}
      self.judge(built[NORM], towers.get(DEVICE), towers.get(INDEX),
                 output=built.get(OUTPUT_NORM),
                 shared=built.get(SHARED_NORM))
    judged = self._judged
    fired = judged["flags"]
    if self.leave_out and len(judged["slots"]) > 1:
      fired = tf.constant(False)
    flag = tf.logical_and(tf.reduce_any(fired),
                          tf.logical_not(context.nonfinite),
                          name="tower_outlier")
    return flag, dict(judged["values"])

  def _fold(self):
    """Ops folding the step's excesses in (not an outlier's; a dry
    run's, which change nothing, all)."""
    state, judged = self._state, self._judged
    slots = tf.constant(np.array(judged["slots"])[:, None])
    count = state["count"].read_value() + 1
    rate = tf.maximum(1.0 / tf.cast(count, tf.float32),
                      1.0 - self.config.decay)
    mean = tf.gather(state["mean"].read_value(), judged["slots"])
    var = tf.gather(state["var"].read_value(), judged["slots"])
    delta = judged["excess"] - mean
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

  def _against(self):
    return ("what its batch explains by the other towers" if self._explained
            else "the other towers' median")

  def tower_words(self, values, position):
    """Why the tower at `position` is an outlier, from fetched values."""
    return ("gradient norm %.4gx %s (usually %.4gx): %.4g sigma > %g, min "
            "factor %g" % (
                values["ratio"][position], self._against(),
                values["usual"][position],
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
    """"tower 2 (/device:CPU:2): gradient norm 10.1x what its batch
    explains by the other towers (usually 1.1x): 48 sigma > 6, min factor
    3" (without output norms: "the other towers' median"), or for 2 towers
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
