"""The first-run check: whatever runs a guarded step, the first run is checked.

`SkipNonFiniteOptimizer` (unless `check_runs=False`) hands each step it
builds to `watch`, which installs, once per process, a check on the session
run paths: `BaseSession.run` (plain loops, `MonitoredTrainingSession`,
`Supervisor` and `slim.learning.train`), `make_callable`, and
`_make_callable_from_options` (the path Keras' graph functions use). The
first time a graph's session runs a distinct set of fetches and feeds that
executes a watched step, `write_check.findings` is told (`run_advice`):
writes outside the decision, several guarded steps in one run, a
global_step advanced twice; a run of no step that writes statistics a skip
restores is told too. Every later run of those fetches pays a dict
lookup (a new structure over the same ops, a set lookup; past
`_MAX_CACHED` sets, new ones are not walked); graphs without a watched step
pay one attribute lookup.
"""

import functools
import threading

from absl import logging
import tensorflow as tf

from tensorflow.python.client import session as session_lib  # pylint: disable=g-direct-tensorflow-import

from tf1_safe_train.core import fetch_gate
from tf1_safe_train.core import run_advice
from tf1_safe_train.core import user_words
from tf1_safe_train.core import write_check

# Graph attribute: the graph's `GraphCheck`.
_ATTRIBUTE = "_tf1_safe_train_run_check"
# Distinct fetch sets (ops and fed names) walked per graph: a loop runs a
# few; past the bound new ones are not checked (a caller that builds new
# ops for every run would otherwise pay a walk of the graph at every run).
_MAX_CACHED = 256

_install_lock = threading.Lock()
_originals = {}


def _sequence_key(fetches):
  return tuple(map(_key, fetches))


def _dict_key(fetches):  # Keys: strings, or hooks (by identity).
  return tuple((k, _key(v)) for k, v in fetches.items())


def _op_key(fetch):
  # A variable, a sparse tensor: by the op it stands for (a variable's
  # own hash raises where eager execution is on outside the graph).
  return (type(fetch), id(getattr(fetch, "op", fetch)))


def _key_function(kind):
  """How to key fetches of type `kind`. A graph's ops and their tensors
  are keyed by identity: they live as long as the graph, which holds the
  cache (their own `__hash__` is slow)."""
  if issubclass(kind, str):
    return str
  if issubclass(kind, (list, tuple)):
    return _sequence_key
  if issubclass(kind, dict):
    return _dict_key
  if issubclass(kind, (tf.Operation, tf.Tensor)):
    return id
  return _op_key


# type -> its key function, filled as types are met.
_KEY_FUNCTIONS = {}


def _key(fetches):
  """A hashable key for a nest of fetches or feeds, cheap to build."""
  kind = type(fetches)
  function = _KEY_FUNCTIONS.get(kind)
  if function is None:
    function = _KEY_FUNCTIONS[kind] = _key_function(kind)
  return function(fetches)


def _leaves(fetches):
  if isinstance(fetches, (list, tuple)):
    for f in fetches:
      yield from _leaves(f)
  elif isinstance(fetches, dict):  # Keys may be hooks: values only.
    for f in fetches.values():
      yield from _leaves(f)
  elif fetches is not None:
    yield fetches


def _fetched_ops(graph, fetches):
  """The Operations a run of `fetches` runs; what cannot be resolved is
  left to the run itself to refuse."""
  ops = []
  for leaf in _leaves(fetches):
    try:
      ops.extend(fetch_gate.fetched_ops(graph, [leaf]))
    except (KeyError, ValueError, TypeError):
      continue
  return ops


def _fed_names(feeds):
  names = set()
  for key in feeds or ():
    name = getattr(key, "name", key)
    if isinstance(name, str):
      names.add(name if ":" in name else name + ":0")
  return frozenset(names)


class GraphCheck(object):
  """The watched steps of one graph and the fetch sets already checked.

  A run is looked up by the structure of its fetches and feeds (cheap); a
  new structure is resolved to the ops it fetches, and only a new set of
  ops (with its fed names) is walked. Past `_MAX_CACHED` such sets, new
  ones are not checked (said once): a loop that builds new fetch ops for
  every run would otherwise walk the graph at every run.
  """

  def __init__(self):
    self.steps = []
    # The number of walks (distinct fetch sets checked): for tests.
    self.walks = 0
    self._checked = {}  # Structure key -> True.
    self._walked = set()  # (fetched ops, caller's ops, fed names).
    self._full = False  # Past `_MAX_CACHED` walks (said once).
    self._lock = threading.Lock()

  def add(self, step):
    with self._lock:
      self.steps.append(step)
      # A checked run may execute the new step.
      self._checked.clear()
      self._walked.clear()

  def before_run(self, graph, fetches, feeds):
    """Checks a run of `fetches` with `feeds` (keys) the first time only."""
    key = (_key(fetches), _key(list(feeds)) if feeds else None)
    if key not in self._checked:
      self._first_run(key, graph, fetches, feeds)

  def _remember(self, key):
    if len(self._checked) >= 4 * _MAX_CACHED:
      self._checked.clear()  # Rebuilt from `_walked` at a dict's cost.
    self._checked[key] = True

  def _first_run(self, key, graph, fetches, feeds):
    with self._lock:
      if key in self._checked:
        return
      ops = _fetched_ops(graph, fetches)
      # A MonitoredSession runs {"caller": fetches, hook: its fetches}.
      callers = (_fetched_ops(graph, fetches["caller"])
                 if isinstance(fetches, dict) and "caller" in fetches
                 else None)
      fed = _fed_names(feeds)
      walk_key = (frozenset(ops), frozenset(callers or ()), fed)
      if walk_key in self._walked:
        self._remember(key)
        return
      if len(self._walked) >= _MAX_CACHED:
        self._remember(key)
        if not self._full:
          self._full = True
          logging.warning(
              "tf1_safe_train: the first-run check has checked %d distinct "
              "fetch sets of this graph and checks no new one (a loop that "
              "builds new fetch ops for every run?)", _MAX_CACHED)
        return
      self.walks += 1
      try:
        found = write_check.findings(ops, self.steps, fed, callers=callers)
      except Exception as e:  # pylint: disable=broad-except
        self._not_analysed(ops, feeds, e)
        self._walked.add(walk_key)
        self._remember(key)
        return
      # Raises if strict (not remembered: the next run is refused too).
      run_advice.tell(ops, found, any(s.strict for s in found.steps),
                      self.steps)
      self._walked.add(walk_key)
      self._remember(key)

  def _not_analysed(self, ops, feeds, error):
    """Says that a run the walk could not read is not checked.

    A graph the walk cannot read (a bug of ours, an op it does not know)
    must not stop a run the user's code would make, but what was not
    checked is said (strict: the run is refused) — if the run executes a
    watched step, or if even that cannot be told.
    """
    try:
      walked = fetch_gate.ancestors(ops, _fed_names(feeds))
      ran = [s for s in self.steps if s.applied.op in walked]
    except Exception:  # pylint: disable=broad-except
      ran = self.steps
    if not ran:
      return
    message = ("tf1_safe_train: the first-run check could not analyse a run "
               "of %s (%s: %s): what it writes outside the skip decision is "
               "not checked" % ([op.name for op in ops][:3],
                                type(error).__name__, error))
    if any(s.strict for s in ran):
      raise ValueError(message) from error
    logging.warning("%s", message)


def graph_check(graph):
  """The `GraphCheck` of `graph`, or None if no step of it is watched."""
  return getattr(graph, _ATTRIBUTE, None)


def _run(self, fetches, feed_dict=None, options=None, run_metadata=None):
  check = getattr(self._graph, _ATTRIBUTE, None)  # pylint: disable=protected-access
  if check is not None:
    check.before_run(self._graph, fetches, feed_dict)  # pylint: disable=protected-access
  return _originals["run"](self, fetches, feed_dict, options, run_metadata)


def _make_callable(self, fetches, feed_list=None, accept_options=False):
  check = getattr(self._graph, _ATTRIBUTE, None)  # pylint: disable=protected-access
  if check is not None:
    check.before_run(self._graph, fetches, feed_list)  # pylint: disable=protected-access
  return _originals["make_callable"](self, fetches, feed_list,
                                     accept_options)


def _make_callable_from_options(self, callable_options):
  check = getattr(self._graph, _ATTRIBUTE, None)  # pylint: disable=protected-access
  if check is not None:
    fetches = tuple(callable_options.fetch) + tuple(callable_options.target)
    feeds = tuple(callable_options.feed) + tuple(
        c.to_tensor for c in callable_options.tensor_connection)
    check.before_run(self._graph, fetches, feeds)  # pylint: disable=protected-access
  return _originals["_make_callable_from_options"](self, callable_options)


_PATCHES = {"run": _run, "make_callable": _make_callable,
            "_make_callable_from_options": _make_callable_from_options}


def install():
  """Puts the check on `BaseSession`'s run paths (once per process)."""
  with _install_lock:
    if _originals:
      return
    for name, patch in _PATCHES.items():
      original = getattr(session_lib.BaseSession, name)
      _originals[name] = original
      setattr(session_lib.BaseSession, name,
              functools.wraps(original)(patch))


def original_run():
  """TensorFlow's own `BaseSession.run`, under the check (for benchmarks)."""
  install()
  return _originals["run"]


def watch(step, wrapper=None):
  """Checks the first run of each distinct fetch set that executes `step`.

  Args:
    step: a `write_check.Step`.
    wrapper: the `SkipNonFiniteOptimizer` whose `protect` keys on `step`
      (the advice names what holds it), or None.
  """
  install()
  if wrapper is not None:
    user_words.note_holder(step, wrapper)
  graph = step.applied.graph
  check = graph_check(graph)
  if check is None:
    check = GraphCheck()
    setattr(graph, _ATTRIBUTE, check)
  check.add(step)
