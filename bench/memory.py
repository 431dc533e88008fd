"""Peak resident memory of one phase of a process (Linux), in MiB.

Importing TensorFlow has a peak of its own that would hide a small model's;
`reset_peak_rss` restarts the count so that `peak_rss_mib` covers only what
ran since (elsewhere it falls back to the whole process's peak).
"""

import resource
import sys


def _proc_status_mib(field):
  """A memory field of /proc/self/status (Linux) in MiB, or None."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) / 1024.0  # Reported in kB.
  except OSError:
    pass
  return None


def reset_peak_rss():
  """Restarts the peak-RSS count from the current RSS; False if unsupported.

  Linux (>= 4.0) resets the high-water mark `VmHWM` when "5" is written to
  /proc/self/clear_refs, so the peak of one phase of a process can be read
  without the start-up's peak (importing TensorFlow) hiding it.
  """
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    return False
  return _proc_status_mib("VmHWM") is not None


def current_rss_mib():
  """Resident memory of this process now, in MiB, or None if unknown."""
  return _proc_status_mib("VmRSS")


def peak_rss_mib():
  """Peak resident memory of this process in MiB (since `reset_peak_rss`)."""
  peak = _proc_status_mib("VmHWM")
  if peak is not None:
    return peak
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Linux reports KiB, macOS bytes.
  return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0
