"""`tower_input`: a run that reads an epoch of synthetic data makes each
example once (`synthetic.dataset`'s `make_once`), its ids still attached."""

import tensorflow as tf

from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.inputs import tower_input

tf1 = tf.compat.v1


def _params(**kwargs):
  return params_lib.TrainParams(**kwargs).validate()


class ReadsAnEpochTest(tf.test.TestCase):

  def testOnlyRunsReadingTheWholeSyntheticSplit(self):
    # 10,000 training examples: 157 steps of 2 x 32 read them all.
    self.assertTrue(tower_input.reads_an_epoch(
        _params(max_steps=157, batch_size=32, num_towers=2)))
    self.assertFalse(tower_input.reads_an_epoch(
        _params(max_steps=156, batch_size=32, num_towers=2)))
    self.assertFalse(tower_input.reads_an_epoch(
        _params(max_steps=10**6, dataset="cifar10", data_dir="/nowhere")))

  def testLongRunGathersFromTheTableWithIdsAttached(self):
    with tf.Graph().as_default() as graph:
      towers_input = tower_input.TowerInput(
          _params(max_steps=1250, batch_size=4), worker_index=0,
          num_towers=1)
      ids = tf1.get_collection(tower_input.EXAMPLE_IDS_COLLECTION)
      self.assertEqual(tf.int64, towers_input.store.variables(0)[2].dtype)
      types = [op.type for op in graph.get_operations()]
    self.assertIn("CacheDataset", types)
    self.assertEqual([], ids)  # Tensors join it as towers read.


if __name__ == "__main__":
  tf.test.main()
