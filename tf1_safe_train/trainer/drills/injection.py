"""In-graph injection of NaN/Inf for drills of the skip machinery.

The `Rule`s of a parsed spec (`injection_spec`: 'nan@100:1,inf%0.01') say
which (step, tower, worker) to poison with which value; `active_value`
evaluates them in the graph and `poison` applies them, with an exact
pure-Python twin (`is_active`, `expected_injections`) so tests can count
injections exactly. A probability rule draws from a counter-based generator
keyed by the seed and the rule's index, the same in the graph and in Python.
"""

import tensorflow as tf

from tf1_safe_train.core import gradients
from tf1_safe_train.trainer.drills import injection_spec

tf1 = tf.compat.v1

# The spec's names, kept importable from here.
InjectionSpecError = injection_spec.InjectionSpecError
Rule = injection_spec.Rule
is_scale = injection_spec.is_scale
parse_spec = injection_spec.parse_spec
validate = injection_spec.validate

_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

# splitmix64 (Steele et al., 2014): a counter-based generator made of uint64
# add/multiply/xor/shift, which graph ops and Python ints compute identically.
_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))


def _mix64(z):
  for shift, mult in _MIX:
    z = ((z ^ (z >> shift)) * mult) & _MASK
  return z ^ (z >> 31)


def _rule_key(seed, rule_index):
  return _mix64((_mix64(seed & _MASK) + rule_index) & _MASK)


def uniform(key, step):
  """Returns the uniform number in [0, 1) of `step` in stream `key` (Python)."""
  z = _mix64((key + step * _GAMMA) & _MASK)
  return (z >> 11) * 2.0**-53


def uniform_graph(key, step):
  """Graph twin of `uniform`, bit for bit; `step` is an int64 tensor."""
  u64 = lambda c: tf.constant(c, tf.uint64)
  z = tf.cast(step, tf.uint64) * u64(_GAMMA) + u64(key)
  for shift, mult in _MIX + ((31, None),):
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, u64(shift)))
    if mult is not None:
      z = z * u64(mult)
  return tf.cast(tf.bitwise.right_shift(z, u64(11)), tf.float64) * 2.0**-53


def _selected(rules, tower, worker, scale=None):
  """(index, rule) of `rules` for this tower/worker (and kind, unless None)."""
  return [(i, r) for i, r in enumerate(rules)
          if r.tower == tower and r.worker == worker and
          scale in (None, is_scale(r))]


def is_active(rules, step, tower, worker=0, seed=0):
  """Pure-Python twin of `active_value`, with `step` a Python int.

  Returns:
    (active, value): whether (step, tower, worker) is poisoned and the value
    of the first matching rule (0.0 when not active, as in the graph).
  """
  for i, rule in _selected(rules, tower, worker):
    if (step >= rule.first_step and
        (rule.last_step is None or step <= rule.last_step) and
        (rule.prob is None or uniform(_rule_key(seed, i), step) < rule.prob)):
      return True, rule.value
  return False, 0.0


def active_value(rules, step, tower, worker=0, seed=0, scale=False):
  """Builds the graph deciding whether this tower is poisoned at `step`.

  The ops are colocated with `step` (normally the global_step read, on the
  variables' device): they are a few scalar uint64 ops, not worth a GPU.

  Args:
    rules: sequence of `Rule` (indices in it seed the probability streams).
    step: int64 tensor, the global_step read (any shape works elementwise).
    tower: this tower's index.
    worker: this worker's index.
    seed: int seed of the probability rules.
    scale: the scaleF rules (True) or the nan/inf/-inf ones (False).

  Returns:
    (active, value): bool tensor and float32 tensor (0.0 when not active);
    with no rule for this tower/worker, constants False and 0.0.
  """
  selected = _selected(rules, tower, worker, scale)
  with tf.name_scope('inject_nonfinite'):
    if not selected:
      return tf.constant(False, name='active'), tf.constant(0.0, name='value')
    step = tf.convert_to_tensor(step, dtype=tf.int64)
    with step.graph.colocate_with(step.op):
      active, conds = None, []
      for i, rule in selected:
        cond = step >= rule.first_step
        if rule.last_step is not None:
          cond = tf.logical_and(cond, step <= rule.last_step)
        if rule.prob is not None:
          u = uniform_graph(_rule_key(seed, i), step)
          cond = tf.logical_and(cond, u < rule.prob)
        conds.append((cond, rule.value))
        active = cond if active is None else tf.logical_or(active, cond)
      value = tf.zeros_like(step, dtype=tf.float32)
      for cond, rule_value in reversed(conds):  # The first rule wins.
        value = tf.where(cond, tf.constant(rule_value, tf.float32), value)
      return tf.identity(active, name='active'), tf.identity(value, 'value')


def poison(x, active, value):
  """Returns `x`, or `x` with every element set to `value` when `active`.

  Uses `tf.where`, so nothing non-finite is computed when inactive and the
  gradient wrt `x` is the identity then (zero when active). A statically
  False `active` returns `x` itself.

  Args:
    x: floating Tensor or `IndexedSlices` (its values are poisoned).
    active: scalar bool tensor (or Python bool).
    value: scalar float (tensor), cast to the dtype of `x`.

  Raises:
    ValueError: if `x` is not of a floating dtype.
  """
  if isinstance(x, tf.IndexedSlices):
    return gradients.map_values(lambda t: poison(t, active, value), x)
  x = tf.convert_to_tensor(x)
  if x.dtype.base_dtype not in _FLOAT_DTYPES:
    raise ValueError('poison needs a float16/bfloat16/float32/float64 tensor, '
                     'got %s (%s)' % (x.dtype.name, x.name))
  static = tf.get_static_value(active)
  if static is not None and not static:
    return x
  with tf.name_scope('poison'):
    return tf.where(active, tf.cast(value, x.dtype), x)


def expected_injections(rules, num_steps, num_towers, worker=0, seed=0,
                        start_step=0):
  """Counts injections over steps [start_step, start_step + num_steps).

  Args:
    rules: sequence of `Rule`.
    num_steps: number of steps run.
    num_towers: number of towers of this worker.
    worker: worker index.
    seed: int seed of the probability rules.
    start_step: global step of the first step run (e.g. after a restore).

  Returns:
    (counts, steps): per-tower list of the number of poisoned steps, and the
    set of steps where at least one tower is poisoned.
  """
  counts = [0] * num_towers
  steps = set()
  for step in range(start_step, start_step + num_steps):
    for tower in range(num_towers):
      if is_active(rules, step, tower, worker, seed)[0]:
        counts[tower] += 1
        steps.add(step)
  return counts, steps
