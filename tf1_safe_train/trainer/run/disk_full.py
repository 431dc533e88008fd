"""A full disk, told apart from the errors it arrives as.

A write to a full disk reaches the trainer as Python's `OSError` (ENOSPC)
or, from TensorFlow's file system, as a `ResourceExhaustedError` whose
message is "<path>; No space left on device": the same error class as an
allocation that fails, whose advice (a smaller batch) is wrong for a disk.
This module names the disk problem and the file it hit. It imports no
TensorFlow: it reads the error's errno or message.
"""

import errno
import os
import re

_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_TEXTS = tuple(os.strerror(e) for e in _ERRNOS)


def path_of(error):
  """The file a full disk stopped writing, if `error` is a full disk.

  Args:
    error: an `OSError` or a TensorFlow `OpError` (any exception).

  Returns:
    None if `error` is not a full disk (or exhausted quota); else the path
    it names, or '' if it names none.
  """
  if isinstance(error, OSError) and error.errno is not None:
    if error.errno not in _ERRNOS:
      return None
    return str(error.filename or "")
  message = str(getattr(error, "message", None) or error)
  for text in _TEXTS:
    if text in message:
      # TensorFlow's file system: "<absolute path>; No space left on
      # device" (the path may hold spaces, not newlines or ';').
      found = re.search(r"(/[^\n;]*);\s*" + re.escape(text), message)
      return found.group(1) if found else ""
  return None


def describe(error):
  """One line: "disk full (No space left on device) writing <path>".

  Args:
    error: an error `path_of` recognizes as a full disk.
  """
  path = path_of(error) or ""
  text = next((t for t in _TEXTS if t in str(error)), _TEXTS[0])
  if isinstance(error, OSError) and error.errno in _ERRNOS:
    text = error.strerror or text
  return "disk full (%s)%s" % (text, " writing " + path if path else "")
