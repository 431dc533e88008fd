"""The train_dir a trainer owns: a run's directory, one trainer at a time.

`check` accepts a new or empty directory (log files aside), or one holding a
run of ours (checkpoints, events, run_summary.json, our lock file), and
refuses any other non-empty directory (`--train_dir=/`, a home directory, a
data folder) before anything is written into it. `lock` holds an exclusive
`fcntl.flock` on the directory itself for the process's life: a second
trainer on the same directory refuses and names the first (pid, host, from
`<train_dir>/train.lock`, which the holder writes). Deleting `train.lock` (a
common "stale lock" clean-up) releases nothing: the lock is the directory's,
not a file's. The kernel releases it when the holder dies, even by SIGKILL,
so a crash never leaves it stuck. The holder also flocks `train.lock`, which
keeps out a trainer of an older version (that locked the file only), and is
the whole lock where a directory cannot be flocked (NFS: see `lock`).
"""

import contextlib
import errno
import fcntl
import os
import re
import socket
import tempfile
import time

from absl import logging

from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.inputs import checkpoint_rollback_window

LOCK_FILE = "train.lock"
# What a run of ours leaves in its train_dir (see train_lib, eval_lib).
_OURS = re.compile(r"^(checkpoint|checkpoint\.tmp|graph\.pbtxt|eval|"
                   r"run_summary\.json(\.tmp)?|%s|\.write_test|"
                   r"model\.ckpt-\d+\..*|events\.out\.tfevents\..*)$" %
                   re.escape(LOCK_FILE))


class TrainDirError(ValueError):
  """The train directory cannot be used; the message says why in one line."""


def check(train_dir):
  """Creates `train_dir` if needed; raises TrainDirError if it is not ours.

  Args:
    train_dir: the --train_dir.

  Raises:
    TrainDirError: if it is not writable, or is a non-empty directory that
      holds no run of ours.
  """
  if os.path.lexists(train_dir) and not os.path.isdir(train_dir):
    raise TrainDirError("--train_dir=%s is %s, not a directory: name a new "
                        "or existing directory" % (
                            train_dir, "a file" if os.path.exists(train_dir)
                            else "a dangling symlink"))
  try:
    names = os.listdir(train_dir)
  except FileNotFoundError:
    names = []
  except NotADirectoryError:
    names = None  # makedirs below names the problem.
  except OSError as e:
    raise TrainDirError("--train_dir=%s cannot be read: %s" %
                        (train_dir, e.strerror or e)) from None
  # Log files are allowed in a new run's directory (`train ... > dir/x.log`
  # creates one before the trainer starts).
  if names:
    names = [n for n in names if not n.endswith(".log")]
  if names and not any(_OURS.match(n) for n in names):
    raise TrainDirError(
        "--train_dir=%s is not empty and holds no training run (no "
        "checkpoint, events or run_summary.json; %d other entries, e.g. %s): "
        "use a new or empty directory" % (train_dir, len(names),
                                          sorted(names)[0]))
  _check_read_back(train_dir, names or [])
  try:
    os.makedirs(train_dir, exist_ok=True)
    probe = os.path.join(train_dir, ".write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise TrainDirError("--train_dir=%s is not writable: %s" %
                        (train_dir, e.strerror or e)) from None


def fresh():
  """A new directory's path under the temporary directory, for a run given
  no --train_dir: one per run (time and pid), never a shared default that a
  forgotten flag would silently resume."""
  return os.path.join(tempfile.gettempdir(), "tf1_safe_train-%s-%d" % (
      time.strftime("%Y%m%d-%H%M%S"), os.getpid()))


def _check_read_back(train_dir, names):
  """Refuses a file the run reads back that is not a file (a directory, a
  dangling symlink), before anything is written."""
  logs = [n for n in names if n.startswith("skips-worker") and
          n.endswith(".jsonl")]
  for name in [LOCK_FILE, skip_log.FILENAME,
               checkpoint_rollback_window.FILENAME] + logs:
    problem = skip_log.file_problem(os.path.join(train_dir, name))
    if problem:
      raise TrainDirError("%s %s: remove it (a run writes a file there)" %
                          (os.path.join(train_dir, name), problem))


def _holder(path):
  try:
    with open(path) as f:
      return f.read().strip() or "unknown"
  except FileNotFoundError:
    return "unknown: %s, which names it, was deleted" % LOCK_FILE
  except OSError:
    return "unknown"


def _flock(fd, train_dir, path):
  """Takes `fd`'s exclusive lock, or raises TrainDirError: in use."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    raise TrainDirError(_in_use(train_dir, path)) from None


def _open_directory(train_dir):
  """An fd of `train_dir` holding its exclusive flock (BlockingIOError if
  another process holds it), or None where a directory cannot be flocked.

  Linux's NFS client emulates flock with a byte-range lock, which needs a
  file open for writing: a directory's fails there (EBADF), as on a file
  system without locks (ENOLCK, EOPNOTSUPP).
  """
  fd = os.open(train_dir, os.O_RDONLY | os.O_DIRECTORY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise
  except OSError as e:
    os.close(fd)
    if e.errno in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP,
                   errno.EINVAL):
      return None
    raise
  return fd


def check_free(train_dir):
  """Raises TrainDirError if another process holds `train_dir`'s lock.

  A probe for the checks before TensorFlow's import (`preflight`): it takes
  the locks and lets them go at once, and writes nothing (a refused run
  leaves the directory as it was); `lock` takes them for the run.
  """
  path = os.path.join(train_dir, LOCK_FILE)
  try:
    fd = _open_directory(train_dir)
  except BlockingIOError:
    raise TrainDirError(_in_use(train_dir, path)) from None
  except OSError:
    fd = None  # No directory yet, so no holder; `lock` names other problems.
  if fd is not None:
    os.close(fd)  # Releases it.
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return  # No lock file: no holder of an older version.
  try:
    _flock(fd, train_dir, path)
  finally:
    os.close(fd)  # Releases it.


def _in_use(train_dir, path):
  return ("--train_dir=%s is in use by another trainer (%s); wait for it to "
          "end, stop it, or use another --train_dir" %
          (train_dir, _holder(path)))


@contextlib.contextmanager
def lock(train_dir):
  """Holds `train_dir`'s lock for the `with` block.

  The lock is a flock of the directory (no file's deletion releases it) and
  of `train.lock`, in which the holder writes its pid and host. Where the
  directory cannot be flocked (NFS, see `_open_directory`) `train.lock`'s is
  the lock, with one warning: deleting that file lets a second trainer in.

  Args:
    train_dir: an existing, writable directory (see `check`).

  Yields:
    None.

  Raises:
    TrainDirError: if another process holds the lock.
  """
  path = os.path.join(train_dir, LOCK_FILE)
  with contextlib.ExitStack() as stack:
    try:
      dir_fd = _open_directory(train_dir)
    except BlockingIOError:
      raise TrainDirError(_in_use(train_dir, path)) from None
    except OSError as e:
      raise TrainDirError("--train_dir=%s cannot be opened: %s" % (
          train_dir, e.strerror or e)) from None
    if dir_fd is not None:
      stack.callback(os.close, dir_fd)  # Releases the lock.
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise TrainDirError("%s cannot be opened: %s" % (
          path, skip_log.file_problem(path) or e.strerror or e)) from None
    stack.callback(os.close, fd)  # Releases the lock.
    _flock(fd, train_dir, path)
    if dir_fd is None:
      logging.warning("--train_dir=%s cannot be locked as a directory on its "
                      "file system (NFS?): %s alone keeps a second trainer "
                      "out, so do not delete it while a run lasts",
                      train_dir, path)
    os.ftruncate(fd, 0)
    os.write(fd, ("pid %d on host %s\n" % (os.getpid(),
                                           socket.gethostname())).encode())
    yield
