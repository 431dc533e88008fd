"""skips.jsonl: durable appends, torn lines, one record per skip event."""

import json
import os

import numpy as np

import tensorflow as tf

from tf1_safe_train.core import skip_log


def _record(step, worker=0, **more):
  return dict(step=step, worker=worker, time=1.0, reason="nonfinite",
              towers=[], **more)


class SkipLogTest(tf.test.TestCase):

  def testAppendThenReadInStepOrder(self):
    path = skip_log.path(self.get_temp_dir())
    skip_log.append(path, _record(7))
    skip_log.append(path, _record(3, loss=np.float32("nan"),
                                  ids=np.array([4, 5], np.int64)))
    records = skip_log.read(path)
    self.assertEqual([3, 7], [r["step"] for r in records])
    self.assertIsNone(records[0]["loss"])  # Strict JSON: NaN as null.
    self.assertEqual([4, 5], records[0]["ids"])

  # Regression test (issue 23, 1): records of one step overwrote each
  # other, so a restart excluded only the last one's examples.
  def testRecordsOfOneStepAreEachKept(self):
    path = skip_log.path(self.get_temp_dir())
    skip_log.append(path, _record(5, verdict="first"))
    skip_log.append(path, _record(5, verdict="second"))
    skip_log.append(path, _record(3, verdict="third"))
    self.assertEqual(["third", "first", "second"],
                     [r["verdict"] for r in skip_log.read(path)])
    self.assertEqual(["third", "first", "second"],
                     [r["verdict"] for r in skip_log.read_all(
                         os.path.dirname(path))])

  def testTornLastLineIsIgnoredOtherBadLinesAreNot(self):
    path = skip_log.path(self.get_temp_dir())
    skip_log.append(path, _record(1))
    with open(path, "ab") as f:
      f.write(b'{"step": 2, "wor')  # A write cut by SIGKILL.
    self.assertEqual([1], [r["step"] for r in skip_log.read(path)])
    skip_log.append(path, _record(3))  # After the restart: the tail is cut.
    self.assertEqual([1, 3], [r["step"] for r in skip_log.read(path)])
    with open(path, "ab") as f:
      f.write(b"not json\n")
    skip_log.append(path, _record(4))
    with self.assertRaisesRegex(skip_log.SkipLogError, "line 3"):
      skip_log.read(path)

  # Regression test (issue 23, 8): a complete last record without its
  # newline was honoured by read, then cut off by the next append.
  def testCompleteLastLineWithoutNewlineIsKeptAndMended(self):
    path = skip_log.path(self.get_temp_dir())
    skip_log.append(path, _record(1))
    skip_log.append(path, _record(2, verdict="kept"))
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) - 1)  # truncate -s -1
    self.assertEqual([1, 2], [r["step"] for r in skip_log.read(path)])
    skip_log.append(path, _record(3))
    self.assertEqual([1, 2, 3], [r["step"] for r in skip_log.read(path)])
    with open(path, "rb") as f:
      self.assertEqual(3, f.read().count(b"\n"))

  def testTornLastLineIsDroppedWithAWarning(self):
    path = skip_log.path(self.get_temp_dir())
    skip_log.append(path, _record(1))
    with open(path, "ab") as f:
      f.write(b'{"step": 2, "wor')
    with self.assertLogs(level="WARNING") as logs:
      self.assertEqual([1], [r["step"] for r in skip_log.read(path)])
      skip_log.append(path, _record(3))
    self.assertTrue(any("torn" in line for line in logs.output), logs.output)
    self.assertEqual([1, 3], [r["step"] for r in skip_log.read(path)])

  def testInvalidRecordsNameTheLineAndTheProblem(self):
    # (issue 23, 7) Each was a TypeError, AttributeError or a silent
    # misreading where the records are used.
    cases = [
        (dict(step=[5]), "step is [5], not an int >= 0"),
        (dict(step="5"), 'step is "5"'),
        (dict(step=True), "step is true"),
        (dict(worker=-1), "worker is -1"),
        (dict(towers=[{"example_ids": ["abc"]}]), '"abc" is not an integer'),
        (dict(towers=[{"example_ids": [None]}]), "null is not an integer"),
        (dict(towers=[{"example_ids": [2**70]}]), "does not fit int64"),
        (dict(towers=[{"example_ids": [1e300]}]), "1e+300 is not an integer"),
        (dict(towers="x"), "towers is not a list"),
        (dict(replay="x"), 'replay is "x", not an object'),
        (dict(replay={"input_ids": [1.5]}), "replay input_ids: 1.5"),
        (dict(replay={"tower": "0"}), "replay tower"),
        (dict(reproduced="yes"), "reproduced is not"),
        (dict(state_dir=7), "state_dir"),
    ]
    for number, (fields, expected) in enumerate(cases):
      with self.subTest(fields=fields):
        path = os.path.join(self.get_temp_dir(), "case%d.jsonl" % number)
        record = _record(1)
        record.update(fields)
        with open(path, "w") as f:
          f.write(json.dumps(_record(0)) + "\n" + json.dumps(record) + "\n")
        with self.assertRaisesRegex(skip_log.SkipLogError, "line 2: "):
          skip_log.read(path)
        try:
          skip_log.read(path)
        except skip_log.SkipLogError as e:
          self.assertIn(expected, str(e))
          self.assertIn(path, str(e))

  def testDirectoryOrDanglingSymlinkIsRefused(self):
    directory = os.path.join(self.get_temp_dir(), "a_dir.jsonl")
    os.makedirs(directory)
    dangling = os.path.join(self.get_temp_dir(), "dangling.jsonl")
    os.symlink(os.path.join(self.get_temp_dir(), "nowhere", "x"), dangling)
    for path, expected in ((directory, "is a directory"),
                           (dangling, "is a dangling symlink")):
      with self.subTest(path=path):
        with self.assertRaisesRegex(skip_log.SkipLogError, expected):
          skip_log.read(path)
        with self.assertRaisesRegex(skip_log.SkipLogError, expected):
          skip_log.append(path, _record(1))

  def testMissingKeyRefused(self):
    with self.assertRaisesRegex(ValueError, "towers"):
      skip_log.append(skip_log.path(self.get_temp_dir()),
                      dict(step=1, worker=0, time=0.0, reason="nonfinite"))

  def testReadAllMergesWorkers(self):
    directory = self.get_temp_dir()
    skip_log.append(skip_log.path(directory, 1), _record(4, worker=1))
    skip_log.append(skip_log.path(directory), _record(4))
    skip_log.append(skip_log.path(directory), _record(2))
    self.assertEqual([(2, 0), (4, 0), (4, 1)],
                     [(r["step"], r["worker"])
                      for r in skip_log.read_all(directory)])
    self.assertEqual([], skip_log.read(os.path.join(directory, "none")))


if __name__ == "__main__":
  tf.test.main()
