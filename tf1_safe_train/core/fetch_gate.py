"""Whether a hook's fetches would make a run do what its own fetches do not.

A `SessionRunHook`'s fetches run with the caller's: a hook that fetches a
counter read after the train op makes `sess.run(loss, {x: validation})` train
on the validation batch. A `FetchGate` lets a hook fetch only on runs whose
own fetches already run every op with an effect (a variable write, a
stateful op such as an input iterator or a v2 cond) that the hook's fetches
need; on other runs the hook fetches nothing.
"""

from absl import logging
import tensorflow as tf

tf1 = tf.compat.v1

# Stateful op types that change nothing: variables themselves and reads of
# them, checks and prints. A hook may add them to any run.
_HARMLESS_STATEFUL = frozenset([
    "VarHandleOp", "VariableV2", "Variable", "ReadVariableOp",
    "VarIsInitializedOp", "IsVariableInitialized", "Assert", "Print",
    "PrintV2", "Placeholder", "PlaceholderV2", "PlaceholderWithDefault",
])
# Distinct fetch sets remembered per gate (a loop fetches a few; the cache
# only bounds pathological callers).
_MAX_CACHED = 64


def has_effect(op):
  """True if running `op` changes state: it is stateful or writes a ref.

  Ref-variable writes (`Assign`, `ApplyMomentum`, ...) are not marked
  stateful in TensorFlow; they take a ref input instead.
  """
  if op._is_stateful and op.type not in _HARMLESS_STATEFUL:  # pylint: disable=protected-access
    return True
  return any(arg.is_ref for arg in op.op_def.input_arg)


def fetched_ops(graph, fetches):
  """The Operations `fetches` (any nest of fetchable things) run."""
  ops = []
  for fetch in tf.nest.flatten(fetches):
    if fetch is None:
      continue
    if isinstance(fetch, str):
      fetch = graph.as_graph_element(fetch, allow_tensor=True,
                                     allow_operation=True)
    op = fetch if isinstance(fetch, tf1.Operation) else getattr(fetch, "op",
                                                                 None)
    if isinstance(op, tf1.Operation):
      ops.append(op)
  return ops


def _fed_names(feed_dict):
  names = set()
  for key in (feed_dict or {}):
    name = getattr(key, "name", key)
    if isinstance(name, str):
      names.add(name if ":" in name else name + ":0")
  return frozenset(names)


def ancestors(ops, fed=frozenset(), control=True):
  """Every op a run of `ops` executes (inputs and control inputs, walked).

  A fed tensor is not computed: the walk does not go through it. Function
  bodies (a v2 cond's branches) are not entered: the function op stands for
  them.

  Args:
    ops: Operations.
    fed: names of fed tensors.
    control: also walk control inputs (False: only the ops whose values
      `ops` read, e.g. the replay probe's).

  Returns:
    A set of Operations, `ops` included.
  """
  seen, stack = set(), list(ops)
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs if t.name not in fed)
    if control:
      stack.extend(op.control_inputs)
  return seen


class FetchGate(object):
  """Decides, per run, whether a hook's fetches may be added to it."""

  def __init__(self, fetches, on_new_run=None):
    """Creates the gate.

    Args:
      fetches: the hook's fetches (any nest of tensors and ops).
      on_new_run: optional `on_new_run(ops)`, called with the run's fetched
        Operations the first time the gate allows a distinct set of them; it
        may raise to refuse the run (the next such run calls it again).
    """
    self._fetches = fetches
    self._on_new_run = on_new_run
    self._cache = {}

  def allows(self, run_context):
    """True if the run's own fetches run every effect the hook's need.

    Args:
      run_context: the `SessionRunContext` given to `before_run`.

    Returns:
      A bool; the answer is cached per distinct (fetches, feeds) of the run.
    """
    args = run_context.original_args
    graph = run_context.session.graph
    fed = _fed_names(args.feed_dict)
    run_ops = fetched_ops(graph, args.fetches)
    key = (frozenset(op.name for op in run_ops), fed)
    allowed = self._cache.get(key)
    if allowed is None:
      needed = [op for op in ancestors(fetched_ops(graph, self._fetches), fed)
                if has_effect(op)]
      run = ancestors(run_ops, fed)
      missing = [op.name for op in needed if op not in run]
      allowed = not missing
      if missing:
        logging.vlog(1, "a hook does not fetch on runs of %s: its fetches "
                     "would also run %s", sorted(key[0]), missing[:3])
      elif self._on_new_run is not None:
        self._on_new_run(run_ops)
      if len(self._cache) >= _MAX_CACHED:
        self._cache.clear()
      self._cache[key] = allowed
    return allowed
