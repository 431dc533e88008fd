"""Tower placement, tower construction and cross-tower gradient averaging.

A tower is one replica of the model on one device, described as a pure
function of its index (device, name scope) as in slim's
`model_deploy.DeploymentConfig`; variables live once on the variables' device
and are shared by every tower, whose gradients `average_gradients` reduces.
"""

import tensorflow as tf

from tf1_safe_train.core import gradients

tf1 = tf.compat.v1

# Op types that own variable state, placed on the variables' device. Same list
# as `tf1.train.replica_device_setter`'s default `ps_ops` and tf_cnn_benchmarks'
# local/ps device setters.
VARIABLE_OP_TYPES = frozenset([
    'AutoReloadVariable',
    'BoostedTreesEnsembleResourceHandleOp',
    'BoostedTreesQuantileStreamResourceHandleOp',
    'MutableDenseHashTable',
    'MutableDenseHashTableV2',
    'MutableHashTable',
    'MutableHashTableOfTensors',
    'MutableHashTableOfTensorsV2',
    'MutableHashTableV2',
    'VarHandleOp',
    'Variable',
    'VariableV2',
])

_DEVICE_TYPES = ('gpu', 'cpu')


def _merge_device(default, op):
  """Returns `default` with any field already set on `op.device` kept."""
  spec = tf.DeviceSpec.from_string(default)
  return spec.make_merged_spec(
      tf.DeviceSpec.from_string(op.device or '')).to_string()


class TowerConfig(object):
  """Immutable description of the towers: how many, on which devices.

  Attributes:
    num_towers: number of towers (>= 1).
    device_type: 'gpu' or 'cpu'; tower i runs on '/device:<TYPE>:i'.
  """

  __slots__ = ('num_towers', 'device_type', '_variables_device')

  def __init__(self, num_towers=1, device_type='gpu',
               variables_device='/device:CPU:0'):
    """Validates and freezes the configuration.

    Args:
      num_towers: number of towers, an int >= 1.
      device_type: 'gpu' or 'cpu' (case-insensitive).
      variables_device: device string (or `tf.DeviceSpec`) for the variables,
        or a device function such as one returned by
        `tf1.train.replica_device_setter`, called with each variable op.

    Raises:
      ValueError: if an argument is invalid; the message names the value.
    """
    if (isinstance(num_towers, bool) or not isinstance(num_towers, int) or
        num_towers < 1):
      raise ValueError('num_towers must be an int >= 1, got %r' % (num_towers,))
    if (not isinstance(device_type, str) or
        device_type.lower() not in _DEVICE_TYPES):
      raise ValueError('device_type must be one of %s, got %r' %
                       (_DEVICE_TYPES, device_type))
    if isinstance(variables_device, tf.DeviceSpec):
      variables_device = variables_device.to_string()
    if not (isinstance(variables_device, str) or callable(variables_device)):
      raise ValueError('variables_device must be a device string or a device '
                       'function, got %r' % (variables_device,))
    setter = object.__setattr__
    setter(self, 'num_towers', num_towers)
    setter(self, 'device_type', device_type.lower())
    setter(self, '_variables_device', variables_device)

  def __setattr__(self, name, value):
    raise AttributeError('TowerConfig is immutable; cannot set %r' % name)

  def __repr__(self):
    return 'TowerConfig(num_towers=%d, device_type=%r, variables_device=%r)' % (
        self.num_towers, self.device_type, self._variables_device)

  def __eq__(self, other):
    return (isinstance(other, TowerConfig) and
            (self.num_towers, self.device_type, self._variables_device) ==
            (other.num_towers, other.device_type, other._variables_device))

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return hash((self.num_towers, self.device_type, self._variables_device))

  def _check_index(self, i):
    if isinstance(i, bool) or not isinstance(i, int) or not (
        0 <= i < self.num_towers):
      raise ValueError('tower index must be an int in [0, %d), got %r' %
                       (self.num_towers, i))

  def tower_device(self, i):
    """Returns the device string of tower `i`, e.g. '/device:GPU:1'."""
    self._check_index(i)
    return '/device:%s:%d' % (self.device_type.upper(), i)

  def tower_scope(self, i):
    """Returns the name scope of tower `i`, e.g. 'tower_1'."""
    self._check_index(i)
    return 'tower_%d' % i

  def variables_device(self):
    """Returns the variables' device: a device string or a device function."""
    return self._variables_device

  def tower_device_fn(self, i):
    """Returns a device function for `tf1.device` used while building tower i.

    Variable ops (`VARIABLE_OP_TYPES`) go to the variables' device, every
    other op to the tower device. A device already set on the op by an inner
    `tf.device` scope wins field by field, as with string device scopes.

    Args:
      i: tower index.
    """
    tower_device = self.tower_device(i)
    variables_device = self._variables_device

    def device_fn(op):
      if op.type in VARIABLE_OP_TYPES:
        if callable(variables_device):
          return variables_device(op)
        return _merge_device(variables_device, op)
      return _merge_device(tower_device, op)

    return device_fn


def session_config(config, allow_soft_placement=True,
                   log_device_placement=False):
  """Returns a `tf1.ConfigProto` under which the towers' devices exist.

  Args:
    config: a `TowerConfig`.
    allow_soft_placement: let ops without a kernel on the tower device (e.g.
      int32 ops on GPU) fall back to the CPU.
    log_device_placement: log where each op runs.

  Returns:
    A `tf1.ConfigProto`; for 'cpu' towers it asks for `num_towers` virtual CPU
    devices so that '/device:CPU:i' exists for every tower.
  """
  if not isinstance(config, TowerConfig):
    raise ValueError('config must be a TowerConfig, got %r' % (config,))
  proto = tf1.ConfigProto(allow_soft_placement=allow_soft_placement,
                          log_device_placement=log_device_placement)
  if config.device_type == 'cpu':
    proto.device_count['CPU'] = config.num_towers
  return proto


def build_towers(config, tower_fn, skip=()):
  """Calls `tower_fn(i)` once per tower on its device and in its name scope.

  The first tower built (tower 0 unless in `skip`, the indices of towers
  not built) creates the variables (`tf1.get_variable`); the others reuse
  them. Variable names carry no 'tower_i/' prefix because name scopes do not
  affect `get_variable`; op names do ('tower_1/...').

  Args:
    config: a `TowerConfig`.
    tower_fn: callable taking the tower index and returning anything.
    skip: indices of towers not built (quarantined).

  Returns:
    The list of `tower_fn` results of the towers built, in tower order.
  """
  if not isinstance(config, TowerConfig):
    raise ValueError('config must be a TowerConfig, got %r' % (config,))
  if not callable(tower_fn):
    raise ValueError('tower_fn must be callable, got %r' % (tower_fn,))
  results = []
  for i in [i for i in range(config.num_towers) if i not in skip]:
    with tf1.device(config.tower_device_fn(i)), \
        tf.name_scope(config.tower_scope(i)), \
        tf1.variable_scope(tf1.get_variable_scope(),
                           reuse=True if results else None):
      results.append(tower_fn(i))
  return results


def _average(grads, num_towers):
  """Averages one variable's gradients; `grads` holds no None."""
  scale = 1.0 / num_towers
  if all(isinstance(g, tf.IndexedSlices) for g in grads):
    if len(grads) == 1:
      indices = grads[0].indices
      values = grads[0].values
    else:
      int64 = any(g.indices.dtype == tf.int64 for g in grads)
      indices = tf.concat(
          [tf.cast(g.indices, tf.int64) if int64 else g.indices for g in grads],
          axis=0)
      values = tf.concat([g.values for g in grads], axis=0)
    dense_shape = next((g.dense_shape for g in grads
                        if g.dense_shape is not None), None)
    return gradients.map_values(lambda t: t * scale,
                                tf.IndexedSlices(values, indices, dense_shape))
  # Mixed dense and sparse gradients: densify (rare; e.g. one tower gathers).
  grads = [tf.convert_to_tensor(g) for g in grads]
  total = grads[0] if len(grads) == 1 else tf.add_n(grads)
  return total * scale


def average_gradients(tower_grads_and_vars):
  """Averages gradients across towers, variable by variable.

  Each average is built colocated with its variable (`Graph.colocate_with`), so
  it runs on the variables' device and every tower's gradient is copied there
  once, as in cifar10_multi_gpu_train.

  `None` gradients: if every tower has `None` for a variable the result is
  `None`; otherwise a `None` counts as a zero contribution of that tower (its
  loss does not depend on the variable) and the sum is still divided by the
  number of towers. `IndexedSlices` are averaged without densifying, by
  concatenating indices and values (values scaled by 1/num_towers; duplicate
  indices are summed by the optimizer). A mix of dense and `IndexedSlices` is
  densified.

  Args:
    tower_grads_and_vars: one list of (gradient, variable) pairs per tower,
      all listing the same variables in the same order.

  Returns:
    A list of (averaged gradient, variable) pairs. With one tower, the input
    pairs themselves (no op is added).

  Raises:
    ValueError: if there are no towers or the towers' variable lists differ.
  """
  towers = [list(gv) for gv in tower_grads_and_vars]
  if not towers:
    raise ValueError('tower_grads_and_vars is empty')
  first = towers[0]
  for t, gv in enumerate(towers[1:], 1):
    if len(gv) != len(first) or any(
        v is not v0 for (_, v), (_, v0) in zip(gv, first)):
      raise ValueError(
          'tower %d lists variables %s, tower 0 lists %s' %
          (t, [v.name for _, v in gv], [v.name for _, v in first]))
  if len(towers) == 1:
    return first
  averaged = []
  with tf.name_scope('average_gradients'):
    for pairs in zip(*towers):
      var = pairs[0][1]
      grads = [g for g, _ in pairs if g is not None]
      if not grads:
        averaged.append((None, var))
        continue
      with var.graph.colocate_with(var):
        averaged.append((_average(grads, len(towers)), var))
  return averaged
