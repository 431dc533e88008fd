"""skips.jsonl: durable appends, torn lines, one record per step."""

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

  def testRerunStepKeepsTheLastRecord(self):
    path = skip_log.path(self.get_temp_dir())
    skip_log.append(path, _record(5, verdict="first"))
    skip_log.append(path, _record(5, verdict="second"))
    self.assertEqual(["second"], [r["verdict"] for r in skip_log.read(path)])

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
