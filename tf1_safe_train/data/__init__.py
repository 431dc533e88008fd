"""Input pipelines, looked up by name.

`get_dataset` returns a `tf.data.Dataset` of batches (images float32
[batch, 32, 32, 3], labels int32 [batch]) from the embedded synthetic data or
from CIFAR-10 binary files; the train split is shuffled and endless, the test
split one ordered pass. With `with_ids` each batch also carries its examples'
ids (`describe_id` names them), and `exclude_ids` drops examples by id;
`with_ids` and `exclude` do the same for a user pipeline.
"""

import operator

import numpy as np
import tensorflow as tf

from tf1_safe_train.data import cifar10
from tf1_safe_train.data import example_ids
from tf1_safe_train.data import synthetic

# Every dataset is shaped like CIFAR-10.
NUM_CLASSES = cifar10.NUM_CLASSES
IMAGE_SHAPE = cifar10.IMAGE_SHAPE
DATASET_NAMES = ("synthetic", "cifar10")
SPLITS = ("train", "test")


def _check_name_and_split(name, split):
  if name not in DATASET_NAMES:
    raise ValueError("unknown dataset %r; expected one of %s" %
                     (name, ", ".join(DATASET_NAMES)))
  if split not in SPLITS:
    raise ValueError("unknown split %r; expected one of %s" %
                     (split, ", ".join(SPLITS)))


def num_examples(name, split, data_dir=None):
  """Returns the number of examples of a split.

  Args:
    name: one of `DATASET_NAMES`.
    split: one of `SPLITS`.
    data_dir: directory of the CIFAR-10 binary files; ignored for synthetic.

  Returns:
    The number of examples (for cifar10, counted from the file sizes).

  Raises:
    ValueError: if `name` or `split` is unknown.
    cifar10.DataError: if the CIFAR-10 files are missing or damaged.
  """
  _check_name_and_split(name, split)
  if name == "synthetic":
    return synthetic.NUM_EXAMPLES[split]
  return cifar10.num_examples(data_dir, split)


def get_dataset(name, split, batch_size, data_dir=None, seed=0,
                num_parallel_calls=tf.data.AUTOTUNE, with_ids=False,
                exclude_ids=(), make_once=False):
  """Returns the batched input pipeline of a split.

  Args:
    name: one of `DATASET_NAMES`.
    split: "train" (shuffled with `seed`, repeated forever) or "test" (one
      pass in order).
    batch_size: examples per batch, a positive int; the partial last batch is
      dropped, so every batch has exactly this size.
    data_dir: directory of the CIFAR-10 binary files; ignored for synthetic.
    seed: seed of the shuffle (and of the CIFAR-10 augmentation); the
      synthetic examples themselves never depend on it.
    num_parallel_calls: parallelism of decoding / generation.
    with_ids: whether each batch ends with its examples' ids, int64
      [batch_size]: synthetic, the example's index in its split; cifar10,
      `file_number * 10000 + record_number` (the file's position in the
      split's file list, the record within it). See `describe_id`.
    exclude_ids: iterable of example ids to drop, filtered on the id before
      the example is decoded or made; the stream stays deterministic for a
      seed (for cifar10 the other examples keep their augmentation). Ids that
      name no example of the split are ignored.
    make_once: synthetic train split only (ignored otherwise): make each
      example once into a table in memory and gather the batches from it
      (the same batches; see `synthetic.dataset`).

  Returns:
    A `tf.data.Dataset` of (images float32 [batch_size, 32, 32, 3], labels
    int32 [batch_size]), then ids int64 [batch_size] if `with_ids`.

  Raises:
    ValueError: if `name`, `split`, `batch_size` or `exclude_ids` is invalid,
      e.g. a test batch larger than the split, or fewer examples of a train
      split left than a batch (every example excluded: the endless filter
      would wait forever; fewer than a batch: every batch would repeat
      examples).
    cifar10.DataError: if the CIFAR-10 files are missing or damaged.
  """
  _check_name_and_split(name, split)
  batch_size = example_ids.check_batch_size(batch_size)
  excluded = example_ids.normalize(exclude_ids)
  if len(excluded) or split == "test":
    available = num_examples(name, split, data_dir)
    left = available - _count_excluded(name, split, data_dir, excluded)
    if not left:
      raise ValueError("exclude_ids holds all %d examples of the %s %s split"
                       % (available, name, split))
    if split == "train" and batch_size > left:
      # Batched after `repeat`: a batch would repeat its examples.
      raise ValueError("exclude_ids leaves %d of the %d examples of the %s "
                       "train split, fewer than a batch (%d)" %
                       (left, available, name, batch_size))
    if split == "test" and batch_size > left:
      raise ValueError("batch_size %d exceeds the %d examples of the %s test "
                       "split%s, so no full batch exists" %
                       (batch_size, left, name,
                        " left after exclusion" if left < available else ""))
  if name == "synthetic":
    dataset = synthetic.dataset(split, batch_size, seed=seed,
                                num_parallel_calls=num_parallel_calls,
                                with_ids=with_ids, exclude_ids=excluded,
                                make_once=make_once)
  else:
    dataset = cifar10.dataset(data_dir, split, batch_size, seed=seed,
                              num_parallel_calls=num_parallel_calls,
                              with_ids=with_ids, exclude_ids=excluded)
  return dataset.with_options(_options())


def _count_excluded(name, split, data_dir, excluded):
  """How many examples of the split the sorted ids in `excluded` name (ids
  that name none are not counted)."""
  if not len(excluded):
    return 0
  return np.count_nonzero(np.isin(split_ids(name, split, data_dir), excluded))


def split_ids(name, split, data_dir=None):
  """The sorted int64 ids of every example of a split (see `get_dataset`'s
  `with_ids`).

  Raises:
    ValueError: if `name` or `split` is unknown.
    cifar10.DataError: if the CIFAR-10 files are missing or damaged.
  """
  _check_name_and_split(name, split)
  if name == "synthetic":
    return np.arange(synthetic.NUM_EXAMPLES[split], dtype=np.int64)
  return np.sort(np.asarray(cifar10.record_ids(data_dir, split), np.int64))


def describe_id(name, example_id, data_dir=None, split="train"):
  """Returns a human name of an example id of a pipeline.

  Args:
    name: the pipeline's dataset: one of `DATASET_NAMES`, or any other name
      (a user pipeline, see `with_ids`).
    example_id: an int id from `get_dataset(..., with_ids=True)` or
      `with_ids`.
    data_dir: the CIFAR-10 directory; if given, the record must exist there.
    split: the split the id comes from (the trainer's is "train").

  Returns:
    synthetic "train#4711" (split and index), cifar10 "data_batch_2.bin#417"
    (file and record, both from 0), other names "%016x" (the id as an
    unsigned 64-bit hash).

  Raises:
    ValueError: if the id names no example of a synthetic or cifar10 split.
    cifar10.DataError: if `data_dir` is given and its files are damaged.
  """
  example_id = operator.index(example_id)
  if name not in DATASET_NAMES:
    return "%016x" % (example_id % 2**64)
  _check_name_and_split(name, split)
  if name == "cifar10":
    if data_dir is not None and example_id not in cifar10.record_ids(
        data_dir, split):
      raise ValueError("cifar10: %d names no record of the %s split in %s" %
                       (example_id, split, data_dir))
    return cifar10.describe_id(split, example_id)
  if not 0 <= example_id < synthetic.NUM_EXAMPLES[split]:
    raise ValueError("synthetic: %d is not an example id of the %s split" %
                     (example_id, split))
  return "%s#%d" % (split, example_id)


# User pipelines (a trainer's `dataset_fn`): see example_ids.
with_ids = example_ids.with_ids
exclude = example_ids.exclude


def _options():
  """tf.data options of every pipeline: no autotuning thread.

  tf.data's autotuning runs a thread that sleeps for up to a minute between
  rounds, and closing a session waits for it: a run would hang for up to 60 s
  after its last step (measured: 8-50 s on 2 cores). Without it, AUTOTUNE
  values fall back to TensorFlow's defaults (parallel calls: the size of its
  thread pool; prefetching: its own buffer tuning), and the pipeline still
  delivers 20-30 times what training consumes (//bench:towers).
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return options
