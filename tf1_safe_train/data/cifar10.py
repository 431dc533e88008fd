"""Reader of the CIFAR-10 binary format, with the standard augmentation.

A split is a set of files of 3073-byte records: one label byte, then the
32x32x3 image as 1024 red, 1024 green and 1024 blue bytes (row-major, CHW).
The files are validated before any pipeline is built, so a missing or
damaged file fails at once with one line naming it.
"""

import numpy as np
import tensorflow as tf

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
LABEL_BYTES = 1
IMAGE_BYTES = 32 * 32 * 3
RECORD_BYTES = LABEL_BYTES + IMAGE_BYTES
SPLIT_FILES = {
    "train": tuple("data_batch_%d.bin" % i for i in range(1, 6)),
    "test": ("test_batch.bin",),
}
_PADDING = 4  # Pixels of zero padding before the random 32x32 crop.


class DataError(ValueError):
  """A CIFAR-10 directory or file is missing or not in the binary format."""


def _check_split(split):
  if split not in SPLIT_FILES:
    raise ValueError("cifar10: unknown split %r; expected one of %s" %
                     (split, ", ".join(sorted(SPLIT_FILES))))


def check_files(data_dir, split):
  """Validates the files of `split` and returns their paths.

  Args:
    data_dir: directory holding the binary files (the extracted
      `cifar-10-batches-bin`).
    split: "train" or "test".

  Returns:
    The list of file paths, in record order.

  Raises:
    ValueError: if `split` is unknown.
    DataError: if `data_dir` is missing or not a directory, or a file is
      missing, empty or not a whole number of records.
  """
  _check_split(split)
  if not data_dir:
    raise DataError("cifar10: data_dir is required (the directory holding "
                    "%s)" % ", ".join(SPLIT_FILES[split]))
  if not tf.io.gfile.isdir(data_dir):
    raise DataError("cifar10: data_dir %s does not exist or is not a "
                    "directory" % data_dir)
  paths = []
  for filename in SPLIT_FILES[split]:
    path = tf.io.gfile.join(data_dir, filename)
    if not tf.io.gfile.exists(path):
      raise DataError("cifar10: %s does not exist (expected the binary "
                      "version of CIFAR-10)" % path)
    size = tf.io.gfile.stat(path).length
    if size == 0:
      raise DataError("cifar10: %s is empty" % path)
    if size % RECORD_BYTES:
      raise DataError("cifar10: %s is %d bytes, not a multiple of the "
                      "%d-byte record" % (path, size, RECORD_BYTES))
    paths.append(path)
  return paths


def num_examples(data_dir, split):
  """Returns the number of records of `split`; validates like `check_files`."""
  return sum(tf.io.gfile.stat(path).length // RECORD_BYTES
             for path in check_files(data_dir, split))


def decode_record(record):
  """Decodes one record into its image and label.

  Args:
    record: scalar string tensor of RECORD_BYTES bytes.

  Returns:
    (image, label): image float32 [32, 32, 3] HWC with the raw 0-255 pixel
    values, label int32 scalar.
  """
  raw = tf.io.decode_raw(record, tf.uint8)
  label = tf.cast(raw[0], tf.int32)
  # A bad label byte would otherwise reach the loss, where some kernels turn
  # it into NaN rather than an error.
  check = tf.debugging.assert_less(
      label, NUM_CLASSES, message="cifar10: label byte out of range")
  with tf.control_dependencies([check]):
    label = tf.identity(label)
  chw = tf.reshape(raw[LABEL_BYTES:RECORD_BYTES], [3, 32, 32])
  image = tf.cast(tf.transpose(chw, [1, 2, 0]), tf.float32)
  return image, label


def augment(image, seed):
  """Pads by 4 pixels, crops 32x32 at random and flips left-right at random.

  Args:
    image: float32 [32, 32, 3].
    seed: int64 [2] stateless seed; the same seed gives the same result.

  Returns:
    The augmented float32 [32, 32, 3] image.
  """
  crop_seed, flip_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, num=2))
  padded = tf.pad(image, [[_PADDING, _PADDING], [_PADDING, _PADDING], [0, 0]])
  image = tf.image.stateless_random_crop(padded, IMAGE_SHAPE, crop_seed)
  return tf.image.stateless_random_flip_left_right(image, flip_seed)


def dataset(data_dir, split, batch_size, seed=0,
            num_parallel_calls=tf.data.AUTOTUNE):
  """Returns batches of `split`; train shuffles, augments and repeats forever.

  Train examples are shuffled (whole split, reshuffled every epoch with
  `seed`), padded, randomly cropped and flipped, then standardised per image;
  test examples are only standardised, one pass in file order. Augmentation
  is keyed on `seed` and the example's position in the stream, so the stream
  is deterministic despite the parallel decoding.

  Args:
    data_dir: directory holding the binary files.
    split: "train" or "test".
    batch_size: examples per batch; a partial last batch is dropped.
    seed: seed of the shuffle and of the augmentation.
    num_parallel_calls: parallelism of decoding and augmentation.

  Returns:
    A `tf.data.Dataset` of (images float32 [batch_size, 32, 32, 3], labels
    int32 [batch_size]).

  Raises:
    ValueError: if `split` is unknown.
    DataError: if the files fail `check_files`.
  """
  paths = check_files(data_dir, split)
  records = tf.data.FixedLengthRecordDataset(paths, RECORD_BYTES)
  if split == "train":
    size = num_examples(data_dir, split)
    records = records.shuffle(size, seed=seed,
                              reshuffle_each_iteration=True).repeat()
    seed_t = tf.constant(seed, tf.int64)

    def parse(index, record):
      image, label = decode_record(record)
      image = augment(image, tf.stack([seed_t, index]))
      return tf.image.per_image_standardization(image), label

    ds = records.enumerate().map(parse, num_parallel_calls=num_parallel_calls)
  else:

    def parse(record):
      image, label = decode_record(record)
      return tf.image.per_image_standardization(image), label

    ds = records.map(parse, num_parallel_calls=num_parallel_calls)
  return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def write_records(path, images, labels):
  """Writes images and labels to `path` in the CIFAR-10 binary format.

  Args:
    path: file to write (overwritten).
    images: uint8 array [n, 32, 32, 3], HWC.
    labels: integer array [n] with values in [0, NUM_CLASSES).

  Raises:
    ValueError: if the shapes, dtype or label values are wrong.
  """
  images = np.asarray(images)
  labels = np.asarray(labels)
  if images.dtype != np.uint8 or images.ndim != 4 or (
      images.shape[1:] != IMAGE_SHAPE):
    raise ValueError("cifar10: images must be uint8 [n, 32, 32, 3], got %s %s"
                     % (images.dtype, images.shape))
  if labels.shape != images.shape[:1]:
    raise ValueError("cifar10: labels must have shape %s, got %s" %
                     (images.shape[:1], labels.shape))
  if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
    raise ValueError("cifar10: labels must be in [0, %d), got range [%d, %d]"
                     % (NUM_CLASSES, labels.min(), labels.max()))
  chw = images.transpose(0, 3, 1, 2).reshape(len(images), IMAGE_BYTES)
  records = np.concatenate([labels.astype(np.uint8)[:, None], chw], axis=1)
  with tf.io.gfile.GFile(path, "wb") as f:
    f.write(records.tobytes())
