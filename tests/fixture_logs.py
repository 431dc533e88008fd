"""The log records of a run that a test class trains once, in `setUpClass`.

`assertLogs` belongs to a test method; a run shared by a class's tests needs
the same capture (the logger's level lowered, its records kept) outside one.
"""

import unittest


def capture(logger=None, level="INFO"):
  """`assertLogs(logger, level)`'s context manager outside a test method.

  Its `records` and `output` hold what was logged; like `assertLogs` it
  fails when the block logs nothing at `level` or above.
  """
  return unittest.TestCase().assertLogs(logger, level)
