"""Tests of the input pipelines: synthetic data and the CIFAR-10 reader."""

import os

import numpy as np
import tensorflow as tf

from tests.fixtures import dataset_runs
from tf1_safe_train import data
from tf1_safe_train.data import cifar10
from tf1_safe_train.data import synthetic


class GetDatasetTest(dataset_runs.GraphTestCase):

  def testConstantsAgreeWithReaders(self):
    for module in (synthetic, cifar10):
      self.assertEqual(module.NUM_CLASSES, data.NUM_CLASSES)
      self.assertEqual(module.IMAGE_SHAPE, data.IMAGE_SHAPE)

  def testRejectsBadArguments(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(ValueError, "'imagenet'"):
        data.get_dataset("imagenet", "train", 8)
      with self.assertRaisesRegex(ValueError, "'validation'"):
        data.get_dataset("synthetic", "validation", 8)
      for batch_size in (0, -1, 2.5, "8", True, None):
        with self.assertRaisesRegex(ValueError, "batch_size"):
          data.get_dataset("synthetic", "train", batch_size)
      with self.assertRaisesRegex(ValueError, "2001 exceeds the 2000"):
        data.get_dataset("synthetic", "test", 2001)

  def testNoAutotuningThread(self):
    # Closing a session waits for tf.data's autotuning thread, which sleeps
    # up to a minute: a finished run would hang at its end.
    with tf.Graph().as_default():
      for split in ("train", "test"):
        dataset = data.get_dataset("synthetic", split, 8)
        self.assertFalse(dataset.options().autotune.enabled, split)

  def testNumExamples(self):
    self.assertEqual(data.num_examples("synthetic", "train"), 10000)
    self.assertEqual(data.num_examples("synthetic", "test"), 2000)
    with self.assertRaisesRegex(ValueError, "'foo'"):
      data.num_examples("foo", "train")


class SyntheticTest(dataset_runs.GraphTestCase):

  def _first(self, split, seed=0, batch_size=32):
    return self._batches(
        lambda: data.get_dataset("synthetic", split, batch_size, seed=seed),
        num_batches=1)[0]

  def testShapesAndDtypes(self):
    with tf.Graph().as_default():
      ds = data.get_dataset("synthetic", "train", 16)
      self.assertEqual(ds.element_spec[0],
                       tf.TensorSpec([16, 32, 32, 3], tf.float32))
      self.assertEqual(ds.element_spec[1], tf.TensorSpec([16], tf.int32))
    images, labels = self._first("train", batch_size=16)
    self.assertEqual(images.shape, (16, 32, 32, 3))
    self.assertEqual(images.dtype, np.float32)
    self.assertEqual(labels.dtype, np.int32)
    self.assertTrue(np.isfinite(images).all())

  def testTwoBuildsGiveIdenticalBatches(self):
    for split in synthetic.SPLITS:
      first, second = self._first(split), self._first(split)
      self.assertAllEqual(first[0], second[0])
      self.assertAllEqual(first[1], second[1])

  def testSeedShufflesTrainButNeverChangesExamples(self):
    seed0, seed1 = self._first("train", seed=0), self._first("train", seed=1)
    self.assertNotAllClose(seed0[0], seed1[0])
    self.assertAllEqual(self._first("test", seed=0)[0],
                        self._first("test", seed=1)[0])

  def testLabelsAreBalancedOverAllClasses(self):
    for split in synthetic.SPLITS:
      counts = np.bincount(synthetic.labels(split), minlength=10)
      self.assertLen(counts, 10)
      self.assertAllEqual(counts, [synthetic.NUM_EXAMPLES[split] // 10] * 10)
    _, labels = self._arrays(
        lambda: data.get_dataset("synthetic", "train", 64), num_batches=4)
    self.assertLen(np.unique(labels), 10)

  def testTrainAndTestDiffer(self):
    self.assertNotAllClose(self._first("train")[0], self._first("test")[0])
    self.assertNotAllClose(synthetic.labels("train")[:2000],
                           synthetic.labels("test"))

  def testTestSplitIsOnePassInOrder(self):
    images, labels = self._arrays(
        lambda: data.get_dataset("synthetic", "test", 300))
    self.assertLen(labels, 1800)  # 6 full batches, the rest dropped.
    self.assertAllEqual(labels, synthetic.labels("test")[:1800])
    self.assertAllEqual(images[:300], self._first("test", batch_size=300)[0])

  def testLearnableButNotTrivial(self):
    train_x, train_y = self._arrays(lambda: synthetic.examples("train")
                                    .batch(1000))
    test_x, test_y = self._arrays(lambda: synthetic.examples("test")
                                  .batch(1000))
    means = np.stack([train_x[train_y == c].mean(axis=0).ravel()
                      for c in range(10)])
    test_x = test_x.reshape(len(test_x), -1)
    distances = ((test_x ** 2).sum(1, keepdims=True) - 2 * test_x @ means.T +
                 (means ** 2).sum(1))
    accuracy = (distances.argmin(axis=1) == test_y).mean()
    # Nearest class mean gets about 0.52 (chance 0.1); a CNN gets higher.
    self.assertBetween(accuracy, 0.35, 0.9)


class Cifar10Test(dataset_runs.GraphTestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.RandomState(0)
    self.data_dir = self.get_temp_dir()
    self.images, self.labels = {}, {}
    for split, per_file in (("train", 3), ("test", 5)):
      files = cifar10.SPLIT_FILES[split]
      self.images[split] = rng.randint(
          0, 256, size=(per_file * len(files), 32, 32, 3)).astype(np.uint8)
      self.labels[split] = rng.randint(0, 10, size=per_file * len(files))
      for i, filename in enumerate(files):
        part = slice(i * per_file, (i + 1) * per_file)
        cifar10.write_records(os.path.join(self.data_dir, filename),
                              self.images[split][part],
                              self.labels[split][part])

  def _path(self, filename):
    return os.path.join(self.data_dir, filename)

  def testDecodeRecordReadsLabelThenChwPlanes(self):
    # Red plane all 10, green plane counts pixels row-major, blue all 200.
    green = (np.arange(1024) % 256).astype(np.uint8)
    record = bytes([7]) + bytes([10] * 1024) + green.tobytes() + bytes(
        [200] * 1024)
    self.assertLen(record, cifar10.RECORD_BYTES)
    with tf.Graph().as_default() as graph, self.session(graph=graph):
      image, label = self.evaluate(cifar10.decode_record(tf.constant(record)))
    self.assertEqual(label, 7)
    self.assertEqual(image.shape, (32, 32, 3))
    self.assertEqual(image.dtype, np.float32)
    self.assertAllEqual(image[:, :, 0], np.full((32, 32), 10.))
    self.assertAllEqual(image[:, :, 1], green.reshape(32, 32))
    self.assertAllEqual(image[:, :, 2], np.full((32, 32), 200.))
    # write_records produces exactly this record.
    path = self._path("one.bin")
    hwc = np.stack([np.full((32, 32), 10), green.reshape(32, 32),
                    np.full((32, 32), 200)], axis=-1).astype(np.uint8)
    cifar10.write_records(path, hwc[None], [7])
    with open(path, "rb") as f:
      self.assertEqual(f.read(), record)

  def testTestSplitReadsBackInOrderStandardised(self):
    self.assertEqual(data.num_examples("cifar10", "test", self.data_dir), 5)
    images, labels = self._arrays(
        lambda: data.get_dataset("cifar10", "test", 2, self.data_dir))
    self.assertLen(labels, 4)  # Two full batches; the fifth is dropped.
    self.assertAllEqual(labels, self.labels["test"][:4])
    raw = self.images["test"][:4].astype(np.float64)
    mean = raw.mean(axis=(1, 2, 3), keepdims=True)
    std = np.maximum(raw.std(axis=(1, 2, 3), keepdims=True),
                     1. / np.sqrt(raw[0].size))
    self.assertAllClose(images, (raw - mean) / std, atol=1e-4)

  def testTrainSplitAugmentsRepeatsAndKeepsShape(self):
    self.assertEqual(data.num_examples("cifar10", "train", self.data_dir), 15)
    make = lambda: data.get_dataset("cifar10", "train", 4, self.data_dir)
    with tf.Graph().as_default():
      self.assertFalse(make().options().autotune.enabled)
    batches = self._batches(make, num_batches=10)  # 40 > 15: repeats.
    self.assertLen(batches, 10)
    for images, labels in batches:
      self.assertEqual(images.shape, (4, 32, 32, 3))
      self.assertEqual(labels.dtype, np.int32)
      self.assertAllClose(images.mean(axis=(1, 2, 3)), np.zeros(4),
                          atol=1e-4)
    # Shuffled within each epoch, epochs kept whole.
    labels = np.concatenate([b[1] for b in batches])
    self.assertCountEqual(labels[:15], self.labels["train"])
    self.assertCountEqual(labels[15:30], self.labels["train"])
    self.assertNotAllClose(labels[:15], self.labels["train"])
    # Same seed, same stream.
    self.assertAllEqual(self._batches(make, 1)[0][0], batches[0][0])

  def testAugmentIsAPaddedCropOptionallyFlipped(self):
    image = np.random.RandomState(1).randint(1, 256, (32, 32, 3)).astype(
        np.float32)
    padded = np.pad(image, [(4, 4), (4, 4), (0, 0)])
    with tf.Graph().as_default() as graph, self.session(graph=graph):
      outputs = self.evaluate([
          cifar10.augment(tf.constant(image), tf.constant([s, 0], tf.int64))
          for s in range(8)])
    for out in outputs:
      candidates = [c for dy in range(9) for dx in range(9)
                    for c in (padded[dy:dy + 32, dx:dx + 32],
                              padded[dy:dy + 32, dx:dx + 32][:, ::-1])]
      self.assertTrue(any(np.array_equal(out, c) for c in candidates))
    self.assertFalse(all(np.array_equal(outputs[0], o) for o in outputs))

  def _assertDataError(self, split, pattern):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(cifar10.DataError, pattern) as cm:
        data.get_dataset("cifar10", split, 2, self.data_dir)
    self.assertIsInstance(cm.exception, ValueError)
    self.assertNotIn("\n", str(cm.exception))

  def testMissingDataDirRaises(self):
    nowhere = self._path("nowhere")
    self.data_dir = None
    self._assertDataError("train", "data_dir is required")
    self.data_dir = nowhere
    self._assertDataError("test", "nowhere does not exist")

  def testMissingFileRaises(self):
    os.remove(self._path("data_batch_3.bin"))
    self._assertDataError("train", "data_batch_3.bin does not exist")

  def testEmptyFileRaises(self):
    open(self._path("test_batch.bin"), "wb").close()
    self._assertDataError("test", "test_batch.bin is empty")

  def testTruncatedFileRaises(self):
    with open(self._path("data_batch_5.bin"), "r+b") as f:
      f.truncate(1000)
    self._assertDataError(
        "train", "data_batch_5.bin is 1000 bytes, not a multiple of the "
        "3073-byte record")

  def testLabelByteOutOfRangeFails(self):
    with open(self._path("test_batch.bin"), "r+b") as f:
      f.write(bytes([12]))  # The first record's label byte.
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "label byte out of range"):
      self._batches(
          lambda: data.get_dataset("cifar10", "test", 2, self.data_dir))

  def testWriteRecordsRejectsBadArrays(self):
    path = self._path("bad.bin")
    with self.assertRaisesRegex(ValueError, "uint8"):
      cifar10.write_records(path, np.zeros((1, 32, 32, 3)), [0])
    with self.assertRaisesRegex(ValueError, "labels"):
      cifar10.write_records(path, np.zeros((1, 32, 32, 3), np.uint8), [10])


if __name__ == "__main__":
  tf.test.main()
