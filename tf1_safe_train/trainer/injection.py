"""In-graph injection of NaN/Inf for drills of the skip machinery.

A spec such as 'nan@100:1,inf%0.01' parses into immutable `Rule`s saying which
(step, tower, worker) to poison with which value; `active_value` evaluates them
in the graph and `poison` applies them, with an exact pure-Python twin
(`is_active`, `expected_injections`) so tests can count injections exactly.

Spec grammar (comma-separated items, whitespace around items ignored):
  KIND@STEPS[:TOWER][/WORKER]   STEPS is N, N-M (inclusive) or N- (for ever)
  KIND%PROB[:TOWER][/WORKER]    PROB is a per-step probability in (0, 1]
KIND is nan, inf or -inf, or scaleF (F a finite factor > 0, e.g. scale1e4:
a finite spike, multiplying instead of replacing); TOWER and WORKER default
to 0. A step is the value of global_step when the step runs (the first step
of a fresh run is 0).
"""

import collections
import math
import re

import tensorflow as tf

tf1 = tf.compat.v1

# One float object per kind, so that equal Rules compare equal despite NaN.
_VALUES = {'nan': math.nan, 'inf': math.inf, '-inf': -math.inf}
_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

_SCALE_RE = re.compile(r'^scale([0-9.]+(?:e[-+]?[0-9]+)?)$')
_ITEM_RE = re.compile(r'^(?P<kind>[^@%]*)(?P<sep>[@%])(?P<arg>[^:/]*)'
                      r'(?::(?P<tower>[^/]*))?(?:/(?P<worker>.*))?$')
_STEPS_RE = re.compile(r'^([0-9]+)(?:(-)([0-9]*))?$')
_INDEX_RE = re.compile(r'^[0-9]+$')

# splitmix64 (Steele et al., 2014): a counter-based generator made of uint64
# add/multiply/xor/shift, which graph ops and Python ints compute identically.
_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))


class InjectionSpecError(ValueError):
  """A --inject_nonfinite spec or rule is invalid; the message is one line."""


class Rule(collections.namedtuple(
    'Rule', 'kind value first_step last_step prob tower worker')):
  """One injection rule.

  Attributes:
    kind: 'nan', 'inf', '-inf' or 'scale<F>'.
    value: the float written (nan, inf or -inf), or the factor F.
    first_step: first global step poisoned (0 for probability rules).
    last_step: last global step poisoned, inclusive; None for ever.
    prob: per-step probability in (0, 1], or None for step rules.
    tower: tower index poisoned.
    worker: worker (task) index poisoned.
  """
  __slots__ = ()

  def __str__(self):
    if self.prob is not None:
      when = '%%%r' % self.prob
    elif self.last_step == self.first_step:
      when = '@%d' % self.first_step
    else:
      when = '@%d-%s' % (self.first_step,
                         '' if self.last_step is None else self.last_step)
    return '%s%s:%d/%d' % (self.kind, when, self.tower, self.worker)


def _parse_item(item):
  """Parses one stripped, non-empty spec item into a Rule."""

  def fail(what):
    raise InjectionSpecError('--inject_nonfinite item %r: %s' % (item, what))

  match = _ITEM_RE.match(item)
  if not match:
    fail('expected KIND@STEPS[:TOWER][/WORKER] or KIND%PROB[:TOWER][/WORKER]')
  kind = match.group('kind').strip().lower()
  scale = _SCALE_RE.match(kind)
  factor = float(scale.group(1)) if scale else None
  if scale and not 0 < factor < math.inf:
    fail('scale factor must be a finite number > 0, got %r' % scale.group(1))
  if kind not in _VALUES and not scale:
    fail('KIND must be nan, inf, -inf or scaleF (e.g. scale1e4), got %r' %
         match.group('kind').strip())
  arg = match.group('arg').strip()
  prob, last = None, None
  if match.group('sep') == '@':
    steps = _STEPS_RE.match(arg)
    if not steps:
      fail('STEPS must be N, N-M or N-, got %r' % arg)
    first = int(steps.group(1))
    if not steps.group(2):
      last = first
    elif steps.group(3):
      last = int(steps.group(3))
      if last < first:
        fail('STEPS range %r is empty (M < N)' % arg)
    if max(first, last or 0) >= 2**63:
      fail('STEPS must be below 2**63 (int64 global_step), got %r' % arg)
  else:
    first = 0
    try:
      prob = float(arg)
    except ValueError:
      prob = None
    if prob is None or not 0.0 < prob <= 1.0:  # Also rejects 'nan'.
      fail('PROB must be a number in (0, 1], got %r' % arg)
  indices = []
  for name in ('tower', 'worker'):
    text = match.group(name)
    text = '0' if text is None else text.strip()
    if not _INDEX_RE.match(text):
      fail('%s must be a non-negative integer, got %r' % (name.upper(), text))
    indices.append(int(text))
  return Rule(kind, factor if scale else _VALUES[kind], first, last, prob,
              indices[0], indices[1])


def is_scale(rule):
  """True for a finite scale rule (scaleF), False for nan/inf/-inf."""
  return rule.kind.startswith('scale')


def parse_spec(spec):
  """Parses a --inject_nonfinite spec.

  Args:
    spec: the spec string; '' or None means no rules. A trailing or doubled
      comma is an error (it usually hides a typo).

  Returns:
    A tuple of `Rule`s in spec order (earlier rules win on overlap).

  Raises:
    InjectionSpecError: naming the offending item and what is wrong.
  """
  if spec is not None and not isinstance(spec, str):
    raise InjectionSpecError('--inject_nonfinite must be a string, got %r' %
                             (spec,))
  if spec is None or not spec.strip():
    return ()
  rules = []
  for n, item in enumerate(spec.split(','), 1):
    item = item.strip()
    if not item:
      raise InjectionSpecError('--inject_nonfinite item %d of %r is empty '
                               '(stray comma?)' % (n, spec))
    rules.append(_parse_item(item))
  return tuple(rules)


def validate(rules, num_towers, num_workers=1):
  """Checks that every `Rule` names an existing tower and worker.

  Raises:
    InjectionSpecError: for the first rule out of range.
  """
  for rule in rules:
    for name, index, count in (('TOWER', rule.tower, num_towers),
                               ('WORKER', rule.worker, num_workers)):
      if index >= count:
        raise InjectionSpecError(
            '--inject_nonfinite item %r: %s %d out of range, there are %d '
            '(0..%d)' % (str(rule), name, index, count, count - 1))


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
    return tf.IndexedSlices(poison(x.values, active, value), x.indices,
                            x.dense_shape)
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
