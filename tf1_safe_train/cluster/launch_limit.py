"""How many tasks `//:local_cluster` can start on this machine.

Each task holds two of the launcher's open files for its life (the pipes its
stdout and stderr are copied from; one socket each while its port is chosen)
and a port of the machine's ephemeral range (`free_ports` binds port 0). A
cluster larger than either is refused in one line before anything is
opened: `--num_workers=100000` ended in `OSError: Too many open files`.
"""

import resource

_FILES_PER_TASK = 2
# The launcher's own (Python's, the standard streams, and 5 more for a moment
# while a task starts: its pipes' other ends and the exec error pipe).
_SPARE_FILES = 64
PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def max_tasks(port_range=PORT_RANGE):
  """The most tasks this process can start, and why.

  Args:
    port_range: the file holding the ephemeral port range (Linux).

  Returns:
    (count, reason), or (None, None) where no limit is known.
  """
  limits = []
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft != resource.RLIM_INFINITY:
    limits.append((max(0, soft - _SPARE_FILES) // _FILES_PER_TASK,
                   "each task holds %d of the %d open files `ulimit -n` "
                   "allows" % (_FILES_PER_TASK, soft)))
  try:
    with open(port_range) as f:
      low, high = (int(port) for port in f.read().split())
    limits.append((high - low + 1, "each task takes one of the %d ports of "
                   "net.ipv4.ip_local_port_range" % (high - low + 1)))
  except (OSError, ValueError):
    pass  # Not Linux: the open files bound it.
  return min(limits) if limits else (None, None)


def check(num_ps, num_workers):
  """Raises ValueError, naming the flags and the limit, if the cluster has
  more tasks than `max_tasks`."""
  count, reason = max_tasks()
  if count is not None and num_ps + num_workers > count:
    raise ValueError("--num_ps=%d --num_workers=%d: %d tasks are more than "
                     "this launcher can start (at most %d: %s)" % (
                         num_ps, num_workers, num_ps + num_workers, count,
                         reason))
