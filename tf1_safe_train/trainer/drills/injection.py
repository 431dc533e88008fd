"""In-graph injection of faults for drills of the skip machinery.

The `Rule`s of a parsed spec (`injection_spec`: 'nan@100:1,bitflip30%0.01')
say which (step, tower, worker) to fault how; `active_value` evaluates them
in the graph and `poison` / `flip_bit` apply them, with an exact pure-Python
twin (`is_active`, `active_rules`, `expected_injections`, `flip_bit_numpy`)
so tests can count injections exactly. A probability rule draws from a
counter-based generator keyed by the seed and the rule's index, the same in
the graph and in Python.
"""

import numpy as np
import tensorflow as tf

from tf1_safe_train.core import gradients
from tf1_safe_train.trainer.drills import injection_spec

tf1 = tf.compat.v1

# The spec's names, kept importable from here.
InjectionSpecError = injection_spec.InjectionSpecError
GROUPS = injection_spec.GROUPS
Rule = injection_spec.Rule
group = injection_spec.group
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


def _selected(rules, tower, worker, kind_group=None):
  """(index, rule) of `rules` for this tower/worker (and `group`, unless
  None)."""
  return [(i, r) for i, r in enumerate(rules)
          if r.tower == tower and r.worker == worker and
          kind_group in (None, group(r))]


def _hits(rule, index, step, seed):
  """Python: whether `rule` (the `index`-th of its spec) fires at `step`."""
  return (step >= rule.first_step and
          (rule.last_step is None or step <= rule.last_step) and
          (step - rule.first_step) % rule.every == 0 and
          (rule.prob is None or
           uniform(_rule_key(seed, index), step) < rule.prob))


def active_rules(rules, step, tower, worker=0, seed=0):
  """The `Rule`s firing at (step, tower, worker), in spec order (Python).

  A tower may be hit by several at once, one per `group` taking effect
  (the first of each group wins, as in the graph).
  """
  return [r for i, r in _selected(rules, tower, worker)
          if _hits(r, i, step, seed)]


def is_active(rules, step, tower, worker=0, seed=0, kind_group=None):
  """Pure-Python twin of `active_value`, with `step` a Python int.

  Args:
    kind_group: only the rules of this `group` ('value' for what
      `active_value` builds by default); None: any rule.

  Returns:
    (active, value): whether (step, tower, worker) is poisoned and the value
    of the first matching rule (0.0 when not active, as in the graph).
  """
  for i, rule in _selected(rules, tower, worker, kind_group):
    if _hits(rule, i, step, seed):
      return True, rule.value
  return False, 0.0


def active_value(rules, step, tower, worker=0, seed=0, scale=False,
                 kind_group=None):
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
    kind_group: the rules of this `group` (overrides `scale`).

  Returns:
    (active, value): bool tensor and float32 tensor (0.0 when not active);
    with no rule for this tower/worker, constants False and 0.0.
  """
  if kind_group is None:
    kind_group = 'scale' if scale else 'value'
  selected = _selected(rules, tower, worker, kind_group)
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
        if rule.every != 1:
          cond = tf.logical_and(cond, tf.equal(
              tf.math.floormod(step - rule.first_step, rule.every), 0))
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


def flip_bit(x, bit, active):
  """Returns `x` with bit `bit` of its largest-magnitude element flipped
  when `active` (float32 only: 31 the sign, 23-30 the exponent, 0-22 the
  mantissa).

  The element is the first (flat, row-major) of largest |x|: deterministic,
  and the one whose corruption matters most to the tower's first gradient.
  `flip_bit_numpy` is the exact twin.

  Args:
    x: float32 Tensor.
    bit: int scalar (tensor) in [0, 31].
    active: scalar bool tensor (or Python bool).

  Raises:
    ValueError: if `x` is not float32.
  """
  x = tf.convert_to_tensor(x)
  if x.dtype != tf.float32:
    raise ValueError('flip_bit needs a float32 tensor, got %s (%s)' %
                     (x.dtype.name, x.name))
  with tf.name_scope('flip_bit'):
    flat = tf.reshape(x, [-1])
    index = tf.argmax(tf.abs(flat), output_type=tf.int32)
    hit = tf.logical_and(active, tf.equal(tf.range(tf.size(flat)), index))
    mask = tf.bitwise.left_shift(tf.constant(1, tf.uint32),
                                 tf.cast(bit, tf.uint32))
    bits = tf.bitcast(flat, tf.uint32)
    flipped = tf.bitwise.bitwise_xor(
        bits, tf.where(hit, tf.fill(tf.shape(bits), mask),
                       tf.zeros_like(bits)))
    return tf.reshape(tf.bitcast(flipped, tf.float32), tf.shape(x))


def flip_bit_numpy(x, bit):
  """NumPy twin of an active `flip_bit`: (the flipped copy, flat index)."""
  flat = np.array(x, np.float32).reshape(-1)
  index = int(np.argmax(np.abs(flat)))
  bits = flat.view(np.uint32)
  bits[index] ^= np.uint32(1) << np.uint32(bit)
  return bits.view(np.float32).reshape(np.shape(x)), index


def stale(x, active, name='stale_gradient'):
  """Returns `x`, or the value `x` had at the previous run when `active`.

  Keeps that value in a local, non-trainable variable (not checkpointed:
  the first run of a process has none, and a stale fault then gives
  zeros); every run writes `x` into it after reading it, active or not,
  a replay's too (which its probe warns about when built).

  Args:
    x: Tensor with a fully defined shape.
    active: scalar bool tensor.
    name: the variable's name (in the current scope).
  """
  x = tf.convert_to_tensor(x)
  with tf.name_scope('stale'):
    # Not get_variable: a tower's scope may reuse variables.
    previous = tf1.Variable(
        tf.zeros(x.shape, x.dtype), trainable=False, name=name,
        collections=[tf1.GraphKeys.LOCAL_VARIABLES], use_resource=True)
    before = previous.read_value()
    with tf.control_dependencies([before]):
      keep = previous.assign(x, read_value=False)
    with tf.control_dependencies([keep]):
      return tf.where(active, before, x)
