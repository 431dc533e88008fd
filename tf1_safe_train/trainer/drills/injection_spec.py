"""The --inject_nonfinite spec: parsed once into immutable `Rule`s.

A spec such as 'nan@100:1,inf%0.01' says which (step, tower, worker) a drill
poisons with which fault; `parse_spec` turns it into `Rule`s (or one
`InjectionSpecError` line naming the bad item), `validate` checks them
against the towers and workers there are. `injection` evaluates them.

Spec grammar (comma-separated items, whitespace around items ignored):
  KIND@STEPS[:TOWER][/WORKER]   STEPS is N, N-M (inclusive) or N- (for ever),
                                a range optionally ~S: every S-th step of it
  KIND%PROB[:TOWER][/WORKER]    PROB is a per-step probability in (0, 1]
KIND is a non-finite value written (nan, inf, -inf) or a finite fault:
scaleF (F a finite factor > 0, e.g. scale1e4: the target multiplied),
bitflipK (bit K of one float32 element flipped: 31 the sign, 23-30 the
exponent, 0-22 the mantissa; the element is the largest-magnitude one of
the tower's first gradient) or stale (the tower's gradients of the
previous step). TOWER and WORKER default to 0. A step is the value of
global_step when the step runs (the first step of a fresh run is 0).
"""

import collections
import math
import re

# One float object per kind, so that equal Rules compare equal despite NaN.
_VALUES = {'nan': math.nan, 'inf': math.inf, '-inf': -math.inf}

_SCALE_RE = re.compile(r'^scale([0-9.]+(?:e[-+]?[0-9]+)?)$')
_BITFLIP_RE = re.compile(r'^bitflip([0-9]+)$')
STALE = 'stale'
# What each kind does to a tower, one group per way (`group`).
GROUPS = ('value', 'scale', 'bitflip', 'stale')
# Kinds that only make sense on gradients (`validate`'s target).
_GRADS_ONLY = ('bitflip', 'stale')
_KINDS = ('nan, inf, -inf, scaleF (e.g. scale1e4), bitflipK (K 0-31) or '
          'stale')
_ITEM_RE = re.compile(r'^(?P<kind>[^@%]*)(?P<sep>[@%])(?P<arg>[^:/]*)'
                      r'(?::(?P<tower>[^/]*))?(?:/(?P<worker>.*))?$')
_STEPS_RE = re.compile(r'^([0-9]+)(?:(-)([0-9]*))?(?:~([0-9]+))?$')
_INDEX_RE = re.compile(r'^[0-9]+$')


class InjectionSpecError(ValueError):
  """A --inject_nonfinite spec or rule is invalid; the message is one line."""


class Rule(collections.namedtuple(
    'Rule', 'kind value first_step last_step prob tower worker every',
    defaults=(1,))):
  """One injection rule.

  Attributes:
    kind: 'nan', 'inf', '-inf', 'scale<F>', 'bitflip<K>' or 'stale'.
    value: the float written (nan, inf or -inf), the factor F, the bit K
      (a float, as every value), or 0.0 (stale).
    first_step: first global step poisoned (0 for probability rules).
    last_step: last global step poisoned, inclusive; None for ever.
    prob: per-step probability in (0, 1], or None for step rules.
    tower: tower index poisoned.
    worker: worker (task) index poisoned.
    every: S of a range's ~S: the steps first_step + k*S only (1: each).
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
      if self.every != 1:
        when += '~%d' % self.every
    return '%s%s:%d/%d' % (self.kind, when, self.tower, self.worker)


def _parse_item(item):
  """Parses one stripped, non-empty spec item into a Rule."""

  def fail(what):
    raise InjectionSpecError('--inject_nonfinite item %r: %s' % (item, what))

  match = _ITEM_RE.match(item)
  if not match:
    fail('expected KIND@STEPS[:TOWER][/WORKER] or KIND%PROB[:TOWER][/WORKER]')
  kind = match.group('kind').strip().lower()
  value = _kind_value(kind, match.group('kind').strip(), fail)
  arg = match.group('arg').strip()
  prob, last, every = None, None, 1
  if match.group('sep') == '@':
    steps = _STEPS_RE.match(arg)
    if not steps:
      fail('STEPS must be N, N-M or N- (a range optionally ~S), got %r' % arg)
    first = int(steps.group(1))
    if not steps.group(2):
      last = first
    elif steps.group(3):
      last = int(steps.group(3))
      if last < first:
        fail('STEPS range %r is empty (M < N)' % arg)
    if steps.group(4) is not None:
      every = int(steps.group(4))
      if not steps.group(2) or not 1 <= every < 2**63:
        fail('~S needs a range N-M~S or N-~S and S >= 1, got %r' % arg)
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
  return Rule(kind, value, first, last, prob, indices[0], indices[1], every)


def _kind_value(kind, text, fail):
  """The `Rule.value` of lower-cased `kind` (`text` as written)."""
  if kind in _VALUES:
    return _VALUES[kind]
  if kind == STALE:
    return 0.0
  scale = _SCALE_RE.match(kind)
  if scale:
    factor = float(scale.group(1))
    if not 0 < factor < math.inf:
      fail('scale factor must be a finite number > 0, got %r' %
           scale.group(1))
    return factor
  bitflip = _BITFLIP_RE.match(kind)
  if bitflip:
    if int(bitflip.group(1)) > 31:
      fail('bitflip bit must be 0-31 (a float32: 31 sign, 23-30 exponent, '
           '0-22 mantissa), got %s' % bitflip.group(1))
    return float(int(bitflip.group(1)))
  fail('KIND must be %s, got %r' % (_KINDS, text))


def group(rule):
  """What `rule` does to a tower: one of `GROUPS` ('value' writes
  nan/inf/-inf; the others are the finite faults)."""
  for name in GROUPS[1:]:
    if rule.kind.startswith(name):
      return name
  return 'value'


def is_scale(rule):
  """True for a finite scale rule (scaleF), False for the other kinds."""
  return group(rule) == 'scale'


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


def validate(rules, num_towers, num_workers=1, target=None):
  """Checks that every `Rule` names an existing tower and worker, and (with
  a `target`, `--inject_into`) that a gradient-only kind drills gradients.

  Raises:
    InjectionSpecError: for the first rule out of range.
  """
  for rule in rules:
    if target not in (None, 'grads') and group(rule) in _GRADS_ONLY:
      raise InjectionSpecError(
          '--inject_nonfinite item %r: %s faults a tower\'s gradients; it '
          'needs --inject_into=grads, not %s' % (str(rule), rule.kind, target))
    for name, index, count in (('TOWER', rule.tower, num_towers),
                               ('WORKER', rule.worker, num_workers)):
      if index >= count:
        raise InjectionSpecError(
            '--inject_nonfinite item %r: %s %d out of range, there are %d '
            '(0..%d)' % (str(rule), name, index, count, count - 1))
