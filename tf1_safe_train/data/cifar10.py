"""Reader of the CIFAR-10 binary format, with the standard augmentation.

A split is a set of files of 3073-byte records: one label byte, then the
32x32x3 image as 1024 red, 1024 green and 1024 blue bytes (row-major, CHW).
The files are validated before any pipeline is built, so a missing or
damaged file fails at once with one line naming it.
"""

import numpy as np
import tensorflow as tf

from tf1_safe_train.data import example_ids

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
LABEL_BYTES = 1
IMAGE_BYTES = 32 * 32 * 3
RECORD_BYTES = LABEL_BYTES + IMAGE_BYTES
# Example ids number the records of a file below this (CIFAR-10 files hold
# 10000 each): id = file position * ID_STRIDE + record.
ID_STRIDE = 10000
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


def record_ids(data_dir, split):
  """Returns the example ids of `split` in file order, int64 [num_examples].

  The id of record r of the split's file f (its position in `SPLIT_FILES`)
  is `f * ID_STRIDE + r`, fixed by the files, whatever the shuffle.

  Raises:
    ValueError: if `split` is unknown.
    DataError: if the files fail `check_files`, or a file holds more than
      `ID_STRIDE` records (ids of two files would collide).
  """
  ids = []
  for number, path in enumerate(check_files(data_dir, split)):
    count = tf.io.gfile.stat(path).length // RECORD_BYTES
    if count > ID_STRIDE:
      raise DataError("cifar10: %s holds %d records, more than the %d an "
                      "example id can number" % (path, count, ID_STRIDE))
    ids.append(number * ID_STRIDE + np.arange(count, dtype=np.int64))
  return np.concatenate(ids)


def describe_id(split, example_id):
  """Returns "<file>#<record>" for an id of `split` (see `record_ids`).

  Raises:
    ValueError: if `split` is unknown or the id names no file of it.
  """
  _check_split(split)
  number, record = divmod(example_id, ID_STRIDE)
  if not 0 <= number < len(SPLIT_FILES[split]):
    raise ValueError("cifar10: %d is not an example id of the %s split" %
                     (example_id, split))
  return "%s#%d" % (SPLIT_FILES[split][number], record)


def dataset(data_dir, split, batch_size, seed=0,
            num_parallel_calls=tf.data.AUTOTUNE, with_ids=False,
            exclude_ids=()):
  """Returns batches of `split`; train shuffles, augments and repeats forever.

  Train examples are shuffled (whole split, reshuffled every epoch with
  `seed`), padded, randomly cropped and flipped, then standardised per image;
  test examples are only standardised, one pass in file order. Augmentation
  is keyed on `seed` and the example's position in the stream, so the stream
  is deterministic despite the parallel decoding. Excluded examples are
  dropped after that position is counted and before decoding: the others
  keep exactly the augmentation they would have had.

  Args:
    data_dir: directory holding the binary files.
    split: "train" or "test".
    batch_size: examples per batch; a partial last batch is dropped.
    seed: seed of the shuffle and of the augmentation.
    num_parallel_calls: parallelism of decoding and augmentation.
    with_ids: whether the batches end with the examples' ids (`record_ids`).
    exclude_ids: sorted int64 array (`example_ids.normalize`) of ids to drop.

  Returns:
    A `tf.data.Dataset` of (images float32 [batch_size, 32, 32, 3], labels
    int32 [batch_size]), then ids int64 [batch_size] if `with_ids`.

  Raises:
    ValueError: if `split` is unknown.
    DataError: if the files fail `check_files` (or `record_ids` when ids
      are used).
  """
  paths = check_files(data_dir, split)
  records = tf.data.FixedLengthRecordDataset(paths, RECORD_BYTES)
  use_ids = with_ids or len(exclude_ids) > 0
  if use_ids:
    # Zipped before the shuffle, which moves the pairs: its order depends on
    # its seed and size only, so the stream is the same as without ids.
    records = tf.data.Dataset.zip(
        (records,
         tf.data.Dataset.from_tensor_slices(record_ids(data_dir, split))))
  train = split == "train"
  if train:
    size = num_examples(data_dir, split)
    records = records.shuffle(size, seed=seed,
                              reshuffle_each_iteration=True).repeat()
    seed_t = tf.constant(seed, tf.int64)
    # The position in the endless shuffled stream keys the augmentation.
    records = records.enumerate()

  def fields(*element):
    """(position or None, record, id or None) of an element of `records`."""
    position, item = ((element[0], element[1]) if train else
                      (None, element if use_ids else element[0]))
    record, example_id = item if use_ids else (item, None)
    return position, record, example_id

  def parse(*element):
    position, record, example_id = fields(*element)
    image, label = decode_record(record)
    if train:
      image = augment(image, tf.stack([seed_t, position]))
    image = tf.image.per_image_standardization(image)
    return (image, label, example_id) if with_ids else (image, label)

  if len(exclude_ids):
    keep = example_ids.keep_fn(exclude_ids)
    records = records.filter(lambda *element: keep(fields(*element)[2]))
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
