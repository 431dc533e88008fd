"""Whether a running worker's parameter servers are still there."""

import socket
import time

from absl import logging

from tf1_safe_train.cluster import spec as cluster_lib


class ParameterServerWatch(object):
  """Whether the parameter servers are still there, for a running worker.

  TensorFlow's gRPC runtime waits for a lost ps for ever (a step blocks
  until it comes back), and a signal cannot interrupt that wait. Called
  periodically (from `stop_signals.StopOnSignalHook`'s watchdog), this tries
  a TCP connection to each ps; it returns the message to end the worker with
  when a ps has been unreachable for `timeout_secs` in a row, or at once once
  the worker has been told to stop (nothing can be saved: the variables live
  on the ps).
  """

  def __init__(self, config, timeout_secs, connect_secs=2.0):
    self._config = config
    self._timeout_secs = timeout_secs
    self._connect_secs = connect_secs
    self._lost_since = {}

  def __call__(self, interrupted):
    """Returns None while every ps answers (or may still come back)."""
    now = time.monotonic()
    for i, address in enumerate(self._config.ps):
      try:
        with socket.create_connection(cluster_lib.split_address(address),
                                      timeout=self._connect_secs):
          pass
        if self._lost_since.pop(i, None) is not None:
          logging.info("ps %d at %s answers again", i, address)
        continue
      except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
      if i not in self._lost_since:
        self._lost_since[i] = now
        if not interrupted:
          logging.warning("ps %d at %s is unreachable (%s): waiting up to "
                          "%gs for it to come back (--startup_timeout_secs)",
                          i, address, reason, self._timeout_secs)
      if interrupted:
        return ("told to stop while ps %d at %s is unreachable (%s): exiting "
                "without a final checkpoint" % (i, address, reason))
      if now - self._lost_since[i] >= self._timeout_secs:
        return ("lost ps %d at %s: unreachable for %gs (%s; "
                "--startup_timeout_secs); exiting" % (
                    i, address, now - self._lost_since[i], reason))
    return None
