"""The launcher's library: no flags of its own, and the arguments it refuses."""

import os
import subprocess
import sys

import tensorflow as tf

from tf1_safe_train.cluster import cluster_flags
from tf1_safe_train.cluster import local_cluster_lib

_FLAGS_AFTER_IMPORT = """
from absl import flags
import tf1_safe_train.cluster.local_cluster_lib
print(sorted(flags.FLAGS.flags_by_module_dict()))
"""


class LocalClusterLibTest(tf.test.TestCase):

  def testImportDefinesNoFlag(self):
    result = subprocess.run(
        [sys.executable, "-c", _FLAGS_AFTER_IMPORT], capture_output=True,
        text=True, check=False, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), "[]")

  def testClusterFlagsAreRefused(self):
    local_cluster_lib.check_train_args(["--max_steps=3", "--sync_replicas"])
    for name in cluster_flags.NAMES:
      with self.subTest(flag=name):
        with self.assertRaisesRegex(ValueError, "--%s is set by local_cluster"
                                    % name):
          local_cluster_lib.check_train_args(["--%s=1" % name])

  def testClusterOnDistinctFreePorts(self):
    config = local_cluster_lib.make_cluster(num_ps=2, num_workers=2)
    addresses = config.ps + config.worker
    self.assertLen(set(addresses), 4)
    self.assertTrue(config.is_chief)


if __name__ == "__main__":
  tf.test.main()
