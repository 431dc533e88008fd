"""The cluster flags and the choice between them and TF_CONFIG."""

import json

import tensorflow as tf

from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import spec as cluster_lib

_CLUSTER = {"ps": ["10.0.0.1:2222"],
            "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}


def _tf_config():
  return json.dumps({"cluster": _CLUSTER,
                     "task": {"type": "worker", "index": 0}})


class FlagsTest(tf.test.TestCase):

  def testParsesFlags(self):
    config = cluster_flags.from_flags("h0:1", "h1:1, h2:1", "worker", 1)
    self.assertEqual(config.cluster, {"ps": ["h0:1"],
                                      "worker": ["h1:1", "h2:1"]})
    self.assertEqual(config.task_name, "worker 1")

  def testNoFlagsMeansOneMachine(self):
    self.assertIsNone(cluster_flags.from_flags())
    self.assertIsNone(cluster_flags.resolve(None))

  def testRejectsIncompleteFlags(self):
    cases = [
        (("h0:1", "", "worker", 0), "--worker_hosts is required"),
        (("h0:1", "h1:1", "", 0), "--job_name is required"),
        (("", "", "", 3), "--task_index=3 needs"),
        (("", "h1:1", "worker", 0), "no ps task"),
        (("h0:1", "h1:1,", "worker", 0), "stray comma"),
        (("h0:1", "h1:1", "master", 0), "'master' is unknown"),
        (("h0:1", "h1:1", "ps", 1), "out of range: there are 1 ps"),
    ]
    for args, expected in cases:
      with self.subTest(args=args):
        with self.assertRaises(cluster_lib.ClusterSpecError) as e:
          cluster_flags.from_flags(*args)
        self.assertIn(expected, str(e.exception))

  def testTfConfigAndFlagsTogetherIsAnError(self):
    self.assertEqual(
        cluster_flags.resolve(_tf_config(), "", "", "", 0).task_name,
        "worker 0")
    with self.assertRaisesRegex(cluster_lib.ClusterSpecError,
                                "given twice"):
      cluster_flags.resolve(_tf_config(), "h0:1", "h1:1", "worker", 0)

  def testNamesAreTheDeclaredFlags(self):
    self.assertEqual(cluster_flags.NAMES,
                     ("ps_hosts", "worker_hosts", "job_name", "task_index"))


if __name__ == "__main__":
  tf.test.main()
