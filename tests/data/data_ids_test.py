"""Tests of example ids in the input pipelines and of excluding examples."""

import os
from unittest import mock

import numpy as np
import tensorflow as tf

from tests.fixtures import dataset_runs
from tf1_safe_train import data
from tf1_safe_train.data import cifar10
from tf1_safe_train.data import synthetic

tf1 = tf.compat.v1


class SyntheticIdsTest(dataset_runs.GraphTestCase):

  def _get(self, split, batch_size, **kwargs):
    return lambda: data.get_dataset("synthetic", split, batch_size, seed=1,
                                    **kwargs)

  def testIdsAreTheExamplesIndices(self):
    with tf.Graph().as_default():
      spec = data.get_dataset("synthetic", "train", 8,
                              with_ids=True).element_spec
    self.assertEqual(spec[2], tf.TensorSpec([8], tf.int64))
    images, labels, ids = self._columns(
        self._get("train", 8, with_ids=True), num_batches=1)
    self.assertEqual(ids.dtype, np.int64)
    self.assertNotAllEqual(ids, np.arange(8))  # Shuffled indices.
    self.assertAllEqual(labels, synthetic.labels("train")[ids])
    with tf.Graph().as_default() as graph, self.session(graph=graph):
      expected = self.evaluate([
          tf1.data.make_one_shot_iterator(
              synthetic.examples("train").skip(i).take(1)).get_next()[0]
          for i in ids[:3]])
    self.assertAllEqual(images[:3], expected)

  def testIdsKeepTheStream(self):
    for split in ("train", "test"):
      plain = self._columns(self._get(split, 16), num_batches=3)
      with_ids = self._columns(self._get(split, 16, with_ids=True),
                               num_batches=3)
      self.assertAllEqual(plain[0], with_ids[0])
      self.assertAllEqual(plain[1], with_ids[1])
      self.assertLen(plain, 2)  # The default stays (images, labels).

  def testExcludeDropsExactlyThoseIdsInOrder(self):
    excluded = [3, 5, 150, 1999, 123456]  # The last names no example.
    _, labels, ids = self._columns(
        self._get("test", 500, with_ids=True, exclude_ids=excluded))
    kept = [i for i in range(2000) if i not in excluded]
    self.assertAllEqual(ids, kept[:1500])  # Three full batches.
    self.assertAllEqual(labels, synthetic.labels("test")[kept[:1500]])

  def testExcludeAThousandsSetKeepsTheShuffledOrderOfTheOthers(self):
    excluded = np.arange(0, 9000, 2)  # 4500 ids.
    everything = self._columns(self._get("train", 50, with_ids=True),
                               num_batches=8)
    kept = everything[2][~np.isin(everything[2], excluded)]
    images, _, ids = self._columns(
        self._get("train", 50, with_ids=True, exclude_ids=excluded.tolist()),
        num_batches=2)
    self.assertFalse(np.isin(ids, excluded).any())
    self.assertAllEqual(ids, kept[:100])
    # Without with_ids the same examples come, as 2-tuples.
    plain = self._batches(self._get("train", 50, exclude_ids=excluded), 2)
    self.assertLen(plain[0], 2)
    self.assertAllEqual(np.concatenate([b[0] for b in plain]), images)

  def testFilterActsOnIdsBeforeExamplesAreMade(self):
    with tf.Graph().as_default() as graph:
      data.get_dataset("synthetic", "train", 8, exclude_ids=[1])
      maps = [op for op in graph.get_operations()
              if op.type.startswith("ParallelMapDataset")]
    self.assertLen(maps, 1)
    self.assertEqual(maps[0].inputs[0].op.type, "FilterDataset")

  def testFilterCostDoesNotGrowWithTheSet(self):
    # A chain of `equal`s would add nodes per excluded id.
    sizes = []
    for excluded in ([7], range(0, 10000, 3)):
      with tf.Graph().as_default() as graph:
        data.get_dataset("synthetic", "train", 8, exclude_ids=excluded)
        filters = [op for op in graph.get_operations()
                   if op.type == "FilterDataset"]
        self.assertLen(filters, 1)
        predicate = filters[0].get_attr("predicate").name
        functions = {f.signature.name: f
                     for f in graph.as_graph_def().library.function}
        sizes.append(len(functions[predicate].node_def))
    self.assertEqual(sizes[0], sizes[1])

  def testMadeOnceGivesTheSameBatchesAndIdsPastAnEpoch(self):
    # 210 batches of 50 with 7 excluded: past the end of the first epoch
    # (each epoch reshuffled), where the table is read again.
    kwargs = dict(with_ids=True, exclude_ids=[3, 9999, 4711, 5, 8, 13, 21])
    made_once = self._columns(self._get("train", 50, make_once=True,
                                        **kwargs), num_batches=210)
    each_batch = self._columns(self._get("train", 50, **kwargs),
                               num_batches=210)
    for once, each in zip(made_once, each_batch):
      self.assertAllEqual(once, each)
    self.assertAllEqual(made_once[1], synthetic.labels("train")[made_once[2]])

  def testMadeOnceMakesEachExampleOnceInIndexOrder(self):
    # Before: every batch's examples were made from its shuffled ids.
    with tf.Graph().as_default() as graph:
      data.get_dataset("synthetic", "train", 8, with_ids=True,
                       make_once=True)
      types = {op.name: op for op in graph.get_operations()}
      maps = [op for op in types.values()
              if op.type.startswith("ParallelMapDataset")]
    self.assertLen(maps, 1)
    self.assertEqual("RangeDataset", maps[0].inputs[0].op.type)
    self.assertIn("CacheDataset", [op.type for op in types.values()])

  def testMadeOnceLeavesTheTestSplitAndCifarAsTheyAre(self):
    with tf.Graph().as_default() as graph:
      data.get_dataset("synthetic", "test", 8, make_once=True)
      self.assertNotIn("CacheDataset",
                       [op.type for op in graph.get_operations()])

  def testDefaultsAddNoFilter(self):
    with tf.Graph().as_default() as graph:
      data.get_dataset("synthetic", "train", 8, with_ids=True)
      data.get_dataset("synthetic", "train", 8, exclude_ids=[])
      self.assertNotIn("FilterDataset",
                       [op.type for op in graph.get_operations()])

  def testRefusesToExcludeEveryExample(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(
          ValueError, "^exclude_ids holds all 10000 examples of the "
          "synthetic train split$"):
        data.get_dataset("synthetic", "train", 8, exclude_ids=range(10000))
      with self.assertRaisesRegex(
          ValueError, "batch_size 8 exceeds the 7 examples of the synthetic "
          "test split left after exclusion"):
        data.get_dataset("synthetic", "test", 8, exclude_ids=range(1993))

  def testRejectsBadExcludeIds(self):
    with tf.Graph().as_default():
      for bad in (["3"], [1.5], [True], "12", 7, None, [2**63]):
        with self.assertRaisesRegex(ValueError, "exclude_ids"):
          data.get_dataset("synthetic", "train", 8, exclude_ids=bad)

  def testDescribeId(self):
    self.assertEqual(data.describe_id("synthetic", 4711), "train#4711")
    self.assertEqual(data.describe_id("synthetic", np.int64(3), split="test"),
                     "test#3")
    with self.assertRaisesRegex(ValueError, "2000 is not an example id"):
      data.describe_id("synthetic", 2000, split="test")
    self.assertEqual(data.describe_id("my_data", -1), "ffffffffffffffff")
    self.assertEqual(data.describe_id(None, 255), "00000000000000ff")


class Cifar10IdsTest(dataset_runs.GraphTestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.RandomState(0)
    self.data_dir = self.get_temp_dir()
    self.labels = {}
    for split, per_file in (("train", 3), ("test", 5)):
      files = cifar10.SPLIT_FILES[split]
      self.labels[split] = rng.randint(0, 10, size=(len(files), per_file))
      for i, filename in enumerate(files):
        images = rng.randint(0, 256, size=(per_file, 32, 32, 3))
        cifar10.write_records(os.path.join(self.data_dir, filename),
                              images.astype(np.uint8), self.labels[split][i])

  def _get(self, split, batch_size, **kwargs):
    return lambda: data.get_dataset("cifar10", split, batch_size,
                                    self.data_dir, seed=2, **kwargs)

  def testIdsNameFileAndRecord(self):
    _, labels, ids = self._columns(self._get("train", 5, with_ids=True),
                                   num_batches=3)  # One epoch of 15.
    self.assertCountEqual(
        ids, [f * 10000 + r for f in range(5) for r in range(3)])
    self.assertNotAllEqual(ids, np.sort(ids))  # Assigned before the shuffle.
    self.assertAllEqual(labels, self.labels["train"][ids // 10000,
                                                     ids % 10000])
    self.assertEqual(data.describe_id("cifar10", ids[0]),
                     "data_batch_%d.bin#%d" % (ids[0] // 10000 + 1,
                                               ids[0] % 10000))
    _, _, test_ids = self._columns(self._get("test", 2, with_ids=True))
    self.assertAllEqual(test_ids, [0, 1, 2, 3])

  def testIdsKeepTheStream(self):
    # 24 > 15 examples: crosses an epoch, with its reshuffle.
    for split, num_batches in (("train", 6), ("test", None)):
      plain = self._columns(self._get(split, 4), num_batches)
      with_ids = self._columns(self._get(split, 4, with_ids=True),
                               num_batches)
      self.assertAllEqual(plain[0], with_ids[0])
      self.assertAllEqual(plain[1], with_ids[1])

  def testExcludeKeepsTheOthersAndTheirAugmentation(self):
    excluded = [10001, 2, 40000]
    everything = self._columns(self._get("train", 1, with_ids=True),
                               num_batches=30)
    keep = ~np.isin(everything[2], excluded)
    images, labels, ids = self._columns(
        self._get("train", 1, with_ids=True, exclude_ids=excluded),
        num_batches=20)
    self.assertAllEqual(ids, everything[2][keep][:20])
    self.assertAllEqual(labels, everything[1][keep][:20])
    self.assertAllEqual(images, everything[0][keep][:20])
    _, _, test_ids = self._columns(
        self._get("test", 1, with_ids=True, exclude_ids=[1, 3]))
    self.assertAllEqual(test_ids, [0, 2, 4])

  def testRefusesToExcludeEveryExample(self):
    every = [f * 10000 + r for f in range(5) for r in range(3)]
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, "all 15 examples of the "
                                  "cifar10 train split"):
        data.get_dataset("cifar10", "train", 2, self.data_dir,
                         exclude_ids=every)
      # (issue 23, 6) One left: every batch would repeat it.
      with self.assertRaisesRegex(ValueError, "leaves 1 of the 15 examples "
                                  "of the cifar10 train split, fewer than a "
                                  "batch"):
        data.get_dataset("cifar10", "train", 2, self.data_dir,
                         exclude_ids=every[1:])
      data.get_dataset("cifar10", "train", 2, self.data_dir,
                       exclude_ids=every[2:])

  def testRefusesFilesTooLongForIds(self):
    with tf.Graph().as_default(), mock.patch.object(cifar10, "ID_STRIDE", 2):
      data.get_dataset("cifar10", "train", 2, self.data_dir)  # No ids.
      with self.assertRaisesRegex(cifar10.DataError,
                                  "data_batch_1.bin holds 3 records"):
        data.get_dataset("cifar10", "train", 2, self.data_dir, with_ids=True)

  def testDescribeId(self):
    self.assertEqual(data.describe_id("cifar10", 10417),
                     "data_batch_2.bin#417")
    self.assertEqual(data.describe_id("cifar10", 4, self.data_dir, "test"),
                     "test_batch.bin#4")
    with self.assertRaisesRegex(ValueError, "5 names no record"):
      data.describe_id("cifar10", 5, self.data_dir, "test")
    with self.assertRaisesRegex(ValueError, "50000 is not an example id"):
      data.describe_id("cifar10", 50000)


class UserDatasetTest(dataset_runs.GraphTestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.RandomState(3)
    self.images = rng.normal(size=(10, 4, 4, 3)).astype(np.float32)
    self.labels = np.arange(10, dtype=np.int32)

  def _user(self, *extra):
    return tf.data.Dataset.from_tensor_slices(
        (self.images, self.labels) + extra).batch(5)

  def testContentIdsNameTheSameExampleAlike(self):
    _, labels, ids = self._columns(lambda: data.with_ids(self._user()))
    self.assertEqual(ids.dtype, np.int64)
    self.assertLen(np.unique(ids), 10)
    reordered = lambda: data.with_ids(tf.data.Dataset.from_tensor_slices(
        (self.images[::-1], self.labels[::-1])).batch(2))
    _, labels2, ids2 = self._columns(reordered)
    self.assertAllEqual(dict(zip(labels, ids)), dict(zip(labels2, ids2)))

  def testIdFeatureIsKept(self):
    features = np.arange(100, 110, dtype=np.int32)
    images, _, ids = self._columns(lambda: data.with_ids(self._user(features)))
    self.assertAllEqual(ids, features)
    self.assertEqual(ids.dtype, np.int64)
    self.assertAllEqual(images, self.images)
    names = np.array([b"img%d" % i for i in range(10)])
    _, _, hashed = self._columns(lambda: data.with_ids(self._user(names)))
    self.assertLen(np.unique(hashed), 10)

  def testInt64IdFeatureIsTheDatasetItself(self):
    # No map per batch for ids that need no conversion.
    with tf.Graph().as_default():
      dataset = self._user(np.arange(10, dtype=np.int64))
      self.assertIs(data.with_ids(dataset), dataset)

  def testWithIdsRejectsOtherElements(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, "^with_ids: expected a dataset"):
        data.with_ids(tf.data.Dataset.range(3))
      with self.assertRaisesRegex(ValueError, "integers or strings"):
        data.with_ids(self._user(self.images[:, 0, 0, 0]))

  def testExcludeDropsThoseIdsAndRebatches(self):
    ids = np.arange(10, dtype=np.int64)
    make = lambda: data.exclude(self._user(ids), [1, 5], 4)
    batches = self._batches(make)
    self.assertAllEqual([b[2] for b in batches], [[0, 2, 3, 4], [6, 7, 8, 9]])
    self.assertAllEqual(batches[1][0], self.images[6:])

  def testExcludeNothingIsTheDatasetItself(self):
    with tf.Graph().as_default():
      dataset = data.with_ids(self._user())
      self.assertIs(data.exclude(dataset, [], 5), dataset)
      with self.assertRaisesRegex(ValueError, "see with_ids"):
        data.exclude(self._user(), [1], 5)
      with self.assertRaisesRegex(ValueError, "batch_size"):
        data.exclude(dataset, [1], 0)


if __name__ == "__main__":
  tf.test.main()
