"""Input pipelines, looked up by name.

`get_dataset` returns a `tf.data.Dataset` of batches (images float32
[batch, 32, 32, 3], labels int32 [batch]) from the embedded synthetic data or
from CIFAR-10 binary files; the train split is shuffled and endless, the test
split one ordered pass.
"""

import operator

import tensorflow as tf

from tf1_safe_train.data import cifar10
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
                num_parallel_calls=tf.data.AUTOTUNE):
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

  Returns:
    A `tf.data.Dataset` of (images float32 [batch_size, 32, 32, 3], labels
    int32 [batch_size]).

  Raises:
    ValueError: if `name`, `split` or `batch_size` is invalid, e.g. a test
      batch larger than the split.
    cifar10.DataError: if the CIFAR-10 files are missing or damaged.
  """
  _check_name_and_split(name, split)
  try:
    valid = not isinstance(batch_size, bool) and (
        operator.index(batch_size) > 0)
  except TypeError:
    valid = False
  if not valid:
    raise ValueError("batch_size must be a positive int, got %r" %
                     (batch_size,))
  batch_size = operator.index(batch_size)
  if split == "test":
    available = num_examples(name, split, data_dir)
    if batch_size > available:
      raise ValueError("batch_size %d exceeds the %d examples of the %s test "
                       "split, so no full batch exists" %
                       (batch_size, available, name))
  if name == "synthetic":
    dataset = synthetic.dataset(split, batch_size, seed=seed,
                                num_parallel_calls=num_parallel_calls)
  else:
    dataset = cifar10.dataset(data_dir, split, batch_size, seed=seed,
                              num_parallel_calls=num_parallel_calls)
  return dataset.with_options(_options())


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
