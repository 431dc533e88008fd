"""The cluster flags of `//:train`, declared once; where a cluster comes from.

A process's cluster is given by the standard `TF_CONFIG` environment variable
or by the `--ps_hosts`, `--worker_hosts`, `--job_name`, `--task_index` flags
(`FLAGS`, defined by train.py, listed in docs/flags.md). Giving both is an
error: which one a process follows must not depend on a precedence rule
nobody remembers. Like `cluster`, this module never imports TensorFlow.
"""

from tf1_safe_train.cluster import spec as cluster_lib
from tf1_safe_train.trainer.config import flag_specs

_Spec = flag_specs.FlagSpec
FLAGS = (
    _Spec("ps_hosts", "string", "", "Cluster: comma-separated host:port of "
          "the parameter servers (or use TF_CONFIG, not both)."),
    _Spec("worker_hosts", "string", "", "Cluster: comma-separated host:port "
          "of the workers; worker 0 is the chief."),
    _Spec("job_name", "string", "", "Cluster: this task's job, ps or worker."),
    _Spec("task_index", "integer", 0,
          "Cluster: this task's index in its job."),
)
NAMES = tuple(spec.name for spec in FLAGS)


def _split_hosts(flag, value):
  hosts = [h.strip() for h in value.split(",")] if value.strip() else []
  if any(not h for h in hosts):
    raise cluster_lib.ClusterSpecError(
        "--%s=%r has an empty entry (stray comma?)" % (flag, value))
  return hosts


def from_flags(ps_hosts="", worker_hosts="", job_name="", task_index=0):
  """Builds the config from the cluster flags.

  Args:
    ps_hosts: comma-separated 'host:port' list of the parameter servers.
    worker_hosts: comma-separated 'host:port' list of the workers.
    job_name: 'ps' or 'worker'.
    task_index: index of this task in its job.

  Returns:
    A `ClusterConfig`, or None if no cluster flag is set.

  Raises:
    ClusterSpecError: naming what is wrong, in one line.
  """
  ps_hosts, worker_hosts = ps_hosts or "", worker_hosts or ""
  job_name = job_name or ""
  if not (ps_hosts.strip() or worker_hosts.strip() or job_name):
    if task_index:
      raise cluster_lib.ClusterSpecError("--task_index=%r needs --ps_hosts, "
                             "--worker_hosts and --job_name" % (task_index,))
    return None
  if not worker_hosts.strip():
    raise cluster_lib.ClusterSpecError(
        "--worker_hosts is required with --ps_hosts or --job_name")
  if not job_name:
    raise cluster_lib.ClusterSpecError(
        "--job_name is required in a cluster (ps or worker)")
  return cluster_lib.ClusterConfig(ps=_split_hosts("ps_hosts", ps_hosts),
                       worker=_split_hosts("worker_hosts", worker_hosts),
                       job_name=job_name, task_index=task_index)


def resolve(tf_config, ps_hosts="", worker_hosts="", job_name="",
            task_index=0):
  """The cluster of this process, from TF_CONFIG or from the flags.

  Args:
    tf_config: the TF_CONFIG environment value (or None).
    ps_hosts, worker_hosts, job_name, task_index: the cluster flags.

  Returns:
    A `ClusterConfig`, or None to train on this machine alone.

  Raises:
    ClusterSpecError: for a bad spec, or if both sources are given.
  """
  from_env = cluster_lib.from_tf_config(tf_config)
  from_cli = from_flags(ps_hosts, worker_hosts, job_name, task_index)
  if from_env is not None and from_cli is not None:
    raise cluster_lib.ClusterSpecError(
        "the cluster is given twice, by TF_CONFIG and by "
        "--ps_hosts/--worker_hosts/--job_name: unset TF_CONFIG or drop the "
        "flags")
  return from_env if from_env is not None else from_cli
