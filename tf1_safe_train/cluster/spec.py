"""The cluster of a between-graph replicated run, and this process's task in it.

`ClusterConfig` describes a TensorFlow gRPC cluster (parameter servers `ps` and
workers; worker 0 is the chief) and which task this process is. It is built
from the standard `TF_CONFIG` environment variable or from the `--ps_hosts`,
`--worker_hosts`, `--job_name`, `--task_index` flags. This module never imports
TensorFlow (except `ClusterConfig.cluster_spec`), so a binary checks its
cluster before paying for the import.

  TF_CONFIG='{"cluster": {"ps": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
              "task": {"type": "worker", "index": 1}}'

`cluster_flags` declares the flags and chooses between them and TF_CONFIG.
"""

import dataclasses
import itertools
import json
import re
import socket
import time

from tf1_safe_train.core import checks

PS = "ps"
WORKER = "worker"
JOB_NAMES = (PS, WORKER)
TF_CONFIG = "TF_CONFIG"

# Task types other TensorFlow launchers write into TF_CONFIG; named in the
# error so that a user coming from Estimator knows what to change.
_OTHER_TF_CONFIG_JOBS = ("chief", "master", "evaluator")
_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")
# A TF_CONFIG nests 3 levels; json.loads recurses once per level (30,000
# raised RecursionError), so deeper than this is refused before it.
_MAX_TF_CONFIG_DEPTH = 32
_JSON_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


class ClusterSpecError(ValueError):
  """A cluster spec (TF_CONFIG or flags) is invalid; the message is one line."""


class ClusterError(RuntimeError):
  """A task of the cluster cannot start; the message is one line."""


class ClusterUnreachableError(ClusterError):
  """A task of the cluster did not answer within the start-up wait."""


def _as_json(value):
  """`value` as written in TF_CONFIG ("0", true), else its repr."""
  try:
    return json.dumps(value)
  except (TypeError, ValueError):
    return repr(value)


def parse_address(address, where="address"):
  """Checks a `host:port` address and returns it stripped.

  Args:
    address: e.g. '10.0.0.1:2222', 'ps0.example.com:2222' or '[::1]:2222'.
    where: what the address is, for the message (e.g. 'worker 1').

  Returns:
    The address.

  Raises:
    ClusterSpecError: if it is not host:port with a port in 1..65535.
  """
  if not isinstance(address, str):
    raise ClusterSpecError("%s must be a 'host:port' string, got %r" %
                           (where, address))
  address = address.strip()
  host, sep, port = address.rpartition(":")
  if not sep or not host or not _HOST_RE.match(host):
    raise ClusterSpecError("%s %r is not host:port" % (where, address))
  if not port.isdigit() or not 1 <= int(port) <= 65535:
    raise ClusterSpecError("%s %r: port must be a number in 1..65535" %
                           (where, address))
  return address


def split_address(address):
  """Returns (host, port) of a checked address; IPv6 brackets removed."""
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


@dataclasses.dataclass(frozen=True)
class ClusterConfig(object):
  """An immutable, validated cluster and this process's task.

  Attributes:
    ps: tuple of the parameter servers' 'host:port' addresses.
    worker: tuple of the workers' addresses; worker 0 is the chief.
    job_name: 'ps' or 'worker', this process's job.
    task_index: this process's index in its job.
  """
  ps: tuple
  worker: tuple
  job_name: str
  task_index: int

  def __post_init__(self):
    # Lists become tuples so that the config stays immutable and hashable.
    object.__setattr__(self, "ps", tuple(self.ps))
    object.__setattr__(self, "worker", tuple(self.worker))
    self.validate()

  def validate(self):
    """Returns self if valid; raises ClusterSpecError otherwise."""
    if not self.worker:
      raise ClusterSpecError("the cluster has no worker (worker 0 is the "
                             "chief; give at least one)")
    if not self.ps:
      raise ClusterSpecError("the cluster has no ps task: variables live on "
                             "parameter servers; give at least one")
    seen = {}
    for job in JOB_NAMES:
      for i, address in enumerate(getattr(self, job)):
        where = "%s %d" % (job, i)
        address = parse_address(address, where)
        if address in seen:
          raise ClusterSpecError("%s and %s have the same address %s" %
                                 (seen[address], where, address))
        seen[address] = where
    if self.job_name not in JOB_NAMES:
      raise ClusterSpecError(
          "task type %r is unknown: must be ps or worker%s" % (
              self.job_name,
              " (list the chief as worker 0)"
              if self.job_name in _OTHER_TF_CONFIG_JOBS else ""))
    count = len(getattr(self, self.job_name))
    if not checks.is_int(self.task_index):
      # "0" or true would otherwise read as "out of range" (JSON has no
      # integer type of its own: a string or a boolean is a typing slip).
      raise ClusterSpecError("task index %s must be an integer (0..%d for "
                             "%d %s task(s)), got %s" % (
                                 _as_json(self.task_index), count - 1,
                                 count, self.job_name,
                                 type(self.task_index).__name__))
    if not 0 <= self.task_index < count:
      raise ClusterSpecError("task index %r out of range: there are %d %s "
                             "task(s) (0..%d)" % (self.task_index, count,
                                                  self.job_name, count - 1))
    return self

  @property
  def cluster(self):
    """The cluster as a dict {'ps': [...], 'worker': [...]}."""
    return {PS: list(self.ps), WORKER: list(self.worker)}

  @property
  def num_ps(self):
    return len(self.ps)

  @property
  def num_workers(self):
    return len(self.worker)

  @property
  def is_chief(self):
    """Worker 0 saves checkpoints and summaries and writes run_summary.json."""
    return self.job_name == WORKER and self.task_index == 0

  @property
  def address(self):
    """This task's own 'host:port'."""
    return getattr(self, self.job_name)[self.task_index]

  @property
  def task_name(self):
    """e.g. 'worker 1' (for logs and messages)."""
    return "%s %d" % (self.job_name, self.task_index)

  def for_task(self, job_name, task_index):
    """The same cluster seen from another task."""
    return dataclasses.replace(self, job_name=job_name, task_index=task_index)

  def to_tf_config(self):
    """This config as a TF_CONFIG JSON string."""
    return json.dumps({"cluster": self.cluster,
                       "task": {"type": self.job_name,
                                "index": self.task_index}}, sort_keys=True)

  def cluster_spec(self):
    """The `tf.train.ClusterSpec` of the cluster (imports TensorFlow)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.train.ClusterSpec(self.cluster)


def from_tf_config(value):
  """Parses a TF_CONFIG value.

  Args:
    value: the JSON string; None, '' or '{}' mean "no cluster".

  Returns:
    A `ClusterConfig`, or None for no cluster.

  Raises:
    ClusterSpecError: naming what is wrong, in one line.
  """
  if value is None or not value.strip():
    return None
  depth = _nesting(value)
  if depth > _MAX_TF_CONFIG_DEPTH:
    raise ClusterSpecError(
        "TF_CONFIG nests arrays or objects %d levels deep (a cluster spec "
        "needs 3; at most %d are accepted)" % (depth, _MAX_TF_CONFIG_DEPTH))
  try:
    config = json.loads(value, object_pairs_hook=_object)
  except ClusterSpecError:
    raise
  except ValueError as e:
    raise ClusterSpecError("TF_CONFIG is not valid JSON (%s)" % e) from None
  if not isinstance(config, dict):
    raise ClusterSpecError("TF_CONFIG must be a JSON object with 'cluster' "
                           "and 'task', got %s" % type(config).__name__)
  if not config:
    return None
  missing = [key for key in ("cluster", "task") if key not in config]
  if missing:
    raise ClusterSpecError("TF_CONFIG lacks %s (it needs 'cluster' and "
                           "'task')" % " and ".join(repr(k) for k in missing))
  cluster, task = config["cluster"], config["task"]
  if not isinstance(cluster, dict):
    raise ClusterSpecError("TF_CONFIG 'cluster' must be an object of job "
                           "lists, got %r" % (cluster,))
  unknown = sorted(set(cluster) - set(JOB_NAMES))
  if unknown:
    raise ClusterSpecError(
        "TF_CONFIG 'cluster' has job %r: only ps and worker are supported "
        "(list the chief as worker 0)" % unknown[0])
  jobs = {}
  for job in JOB_NAMES:
    hosts = cluster.get(job, [])
    if not isinstance(hosts, list):
      raise ClusterSpecError("TF_CONFIG cluster %r must be a list of "
                             "'host:port', got %r" % (job, hosts))
    jobs[job] = hosts
  if not isinstance(task, dict) or "type" not in task:
    raise ClusterSpecError("TF_CONFIG 'task' must be an object with 'type' "
                           "and 'index', got %r" % (task,))
  return ClusterConfig(ps=jobs[PS], worker=jobs[WORKER],
                       job_name=task["type"], task_index=task.get("index", 0))


def _nesting(text):
  """The deepest nesting of JSON arrays and objects in `text`."""
  brackets = re.findall(r"[][{}]", _JSON_STRING_RE.sub("", text))
  return max(itertools.accumulate(1 if b in "[{" else -1 for b in brackets),
             default=0)


def _object(pairs):
  """A JSON object as a dict; a key given twice is refused (json: last wins)."""
  result = {}
  for key, value in pairs:
    if key in result:
      raise ClusterSpecError("TF_CONFIG has the key %s twice in one object: "
                             "give it once" % json.dumps(key))
    result[key] = value
  return result


def wait_for_ps(config, timeout_secs, poll_secs=0.5):
  """Waits until every parameter server accepts a TCP connection.

  A worker checks this before opening a session: TensorFlow itself would wait
  for an absent ps for ever.

  Args:
    config: a `ClusterConfig`.
    timeout_secs: give up after this many seconds.
    poll_secs: pause between attempts.

  Raises:
    ClusterUnreachableError: naming the first ps that did not answer.
  """
  deadline = time.monotonic() + timeout_secs
  for i, address in enumerate(config.ps):
    host, port = split_address(address)
    while True:
      try:
        with socket.create_connection((host, port), timeout=min(
            2.0, max(0.1, deadline - time.monotonic()))):
          break
      except OSError as e:
        if time.monotonic() >= deadline:
          raise ClusterUnreachableError(
              "ps %d at %s is unreachable after %gs (%s); is it running? "
              "(--startup_timeout_secs)" % (i, address, timeout_secs,
                                            e.strerror or e)) from None
        time.sleep(poll_secs)

