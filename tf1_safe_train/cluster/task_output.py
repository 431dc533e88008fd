"""How a local cluster's task output reaches the screen: line by line,
prefixed with its task, without TensorFlow's cleanup warnings.

`//:local_cluster` copies each task's stdout and stderr (`copy_lines`); the
`NOISE` lines, warnings TensorFlow's C++ runtime prints at every cancelled
receive of a cluster graph, go to a log file (`NoiseLog`) instead of the
screen, where they outnumbered the run's own lines.
"""

import re


# TensorFlow's C++ warning each time a worker's or ps's step (or the
# session's end) cancels the pending receives of a cluster graph: 17 of a
# 2-worker run's 73 lines, none a problem. Copied to the noise log instead.
NOISE = re.compile(r"local_rendezvous\.cc:\d+\] Local rendezvous is aborting "
                   r"with status: ABORTED: Cleanup ")


def copy_lines(pipe, out, prefix, lock, noise=None):
  """Copies `pipe` to `out` line by line, each line prefixed; a `NOISE`
  line goes to `noise` (a `NoiseLog`) instead, when given."""
  with pipe:
    for raw in iter(pipe.readline, b""):
      line = raw.decode("utf-8", "replace").rstrip("\r\n")
      with lock:
        if noise is not None and NOISE.search(line):
          noise.write(prefix + line + "\n")
          continue
        out.write(prefix + line + "\n")
        out.flush()


class NoiseLog(object):
  """The file the `NOISE` lines go to, opened at the first one."""

  def __init__(self, path):
    self.path = path
    self.count = 0
    self._file = None

  def write(self, text):
    self.count += 1
    try:
      if self._file is None:
        self._file = open(self.path, "a")
      self._file.write(text)
      self._file.flush()
    except OSError:
      pass  # Noise: losing it loses nothing.

  def close(self):
    if self._file is not None:
      self._file.close()
