"""Type checks the parameter validators share.

`bool` is a subclass of `int` in Python, so `isinstance(True, int)` holds:
`--num_towers=True` from code, or `"index": true` in TF_CONFIG, would pass a
plain `isinstance` check and read as 1.
"""


def is_int(value):
  """True for a Python int that is not a bool."""
  return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
  """True for a Python int or float that is not a bool."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)
