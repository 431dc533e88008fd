"""Running a binary on a small or read-only disk, without changing the host.

The command runs in a mount namespace of its own (`unshare --mount`, with
private propagation): what is mounted there is seen by that command only
and disappears with it, whatever happens to the test. Needs root (or
CAP_SYS_ADMIN); `available()` says whether this machine allows it.
"""

import shlex
import shutil
import subprocess
import tempfile

import binaries

SETUP_FAILED = 99  # The exit code when a mount failed (not the command's).


def available():
  """True if a tmpfs may be mounted in a mount namespace here."""
  if not shutil.which("unshare"):
    return False
  with tempfile.TemporaryDirectory() as probe:
    return run(["true"], tmpfs=("1m", probe), timeout=60).returncode == 0


def run(command, tmpfs=None, read_only=(), copy_out=None, timeout=600):
  """Runs `command` (a list) in a mount namespace of its own.

  Args:
    command: the command and its arguments.
    tmpfs: optional (size, directory): a tmpfs of `size` (e.g. "20m") is
      mounted on `directory` first.
    read_only: directories bind-mounted read-only on themselves.
    copy_out: optional (source, destination): after the command, `source`'s
      content (e.g. the tmpfs's) is copied into `destination`, which the
      test then reads.
    timeout: seconds.

  Returns:
    The `subprocess.CompletedProcess` (text); exit code `SETUP_FAILED` if a
    mount failed.
  """
  q = shlex.quote
  steps = []
  if tmpfs:
    steps.append("mount -t tmpfs -o size=%s tmpfs %s" % (q(tmpfs[0]),
                                                         q(tmpfs[1])))
  for directory in read_only:
    steps.append("mount --bind %s %s && mount -o remount,bind,ro %s" % (
        q(directory), q(directory), q(directory)))
  script = "".join("{ %s; } || exit %d; " % (step, SETUP_FAILED)
                   for step in steps)
  script += '"$@"; code=$?; '
  if copy_out:
    script += "cp -a %s/. %s; " % (q(copy_out[0]), q(copy_out[1]))
  script += "exit $code"
  return subprocess.run(
      ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
       "sh"] + list(command), capture_output=True, text=True,
      env=binaries.env(), timeout=timeout, check=False)
