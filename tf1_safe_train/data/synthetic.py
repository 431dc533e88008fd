"""A small, deterministic, learnable stand-in for CIFAR-10, made in memory.

Each class is a smooth random colour pattern; an example is its class pattern,
randomly translated and scaled, plus a random mixture of all class patterns
(the distractor that keeps accuracy below 100%), a colour shift and pixel
noise. Everything derives from the fixed `DATA_SEED`, never from the training
seed, so every run and both splits see the same classes.
"""

import numpy as np
import tensorflow as tf

from tf1_safe_train.data import cifar10
from tf1_safe_train.data import example_ids

# Shaped like CIFAR-10, so that the same models train on either.
NUM_CLASSES = cifar10.NUM_CLASSES
IMAGE_SHAPE = cifar10.IMAGE_SHAPE
NUM_EXAMPLES = {"train": 10000, "test": 2000}
SPLITS = ("train", "test")
# Fixed on purpose: the data must not change with the training seed.
DATA_SEED = 20160601

# Difficulty. The distractor mixes every class pattern with N(0, MIX_STDDEV)
# weights, so a weak example (low contrast) of one class can look like
# another: this, not pixel noise, bounds the reachable accuracy.
_SINUSOIDS_PER_CLASS = 3
_MAX_FREQUENCY = 3  # Cycles per image; integer so translations wrap exactly.
_CONTRAST_RANGE = (0.5, 1.5)
_MAX_TRANSLATION = 3  # Pixels, in each direction.
_MIX_STDDEV = 0.35
_COLOUR_SHIFT_STDDEV = 0.5
_NOISE_STDDEV = 0.5


def class_patterns():
  """Returns the class patterns, float32 [NUM_CLASSES, 32, 32, 3].

  Each pattern is a sum of sinusoidal gratings with random integer
  frequency, phase and colour, normalised to zero mean and unit variance.
  """
  rng = np.random.default_rng(DATA_SEED)
  height, width, channels = IMAGE_SHAPE
  yy, xx = np.meshgrid(np.arange(height) / height, np.arange(width) / width,
                       indexing="ij")
  patterns = np.zeros((NUM_CLASSES,) + IMAGE_SHAPE, np.float64)
  for c in range(NUM_CLASSES):
    for _ in range(_SINUSOIDS_PER_CLASS):
      fy, fx = 0, 0
      while fy == 0 and fx == 0:
        fy, fx = rng.integers(-_MAX_FREQUENCY, _MAX_FREQUENCY + 1, size=2)
      phase = rng.uniform(0, 2 * np.pi)
      colour = rng.normal(size=channels)
      grating = np.cos(2 * np.pi * (fy * yy + fx * xx) + phase)
      patterns[c] += grating[:, :, None] * colour[None, None, :]
    patterns[c] -= patterns[c].mean()
    patterns[c] /= patterns[c].std()
  return patterns.astype(np.float32)


def labels(split):
  """Returns the labels of `split`, int32 [NUM_EXAMPLES[split]], balanced."""
  _check_split(split)
  n = NUM_EXAMPLES[split]
  rng = np.random.default_rng([DATA_SEED, SPLITS.index(split)])
  return rng.permutation(np.arange(n) % NUM_CLASSES).astype(np.int32)


def _check_split(split):
  if split not in SPLITS:
    raise ValueError("synthetic: unknown split %r; expected one of %s" %
                     (split, ", ".join(SPLITS)))


def _example_fn(split):
  """Returns a function mapping an int64 index to (image, label) of `split`."""
  patterns = tf.constant(class_patterns())
  split_labels = tf.constant(labels(split))
  split_key = tf.constant(DATA_SEED + 1000 * SPLITS.index(split), tf.int64)

  def example(index):
    # Stateless ops keyed on the example's index: example i is the same in
    # every epoch, every run and every pipeline order.
    seeds = tf.random.experimental.stateless_split(
        tf.stack([split_key, index]), num=5)
    label = split_labels[index]
    contrast = tf.random.stateless_uniform(
        [], seeds[0], minval=_CONTRAST_RANGE[0], maxval=_CONTRAST_RANGE[1])
    translation = tf.random.stateless_uniform(
        [2], seeds[1], minval=-_MAX_TRANSLATION, maxval=_MAX_TRANSLATION + 1,
        dtype=tf.int32)
    mix = tf.random.stateless_normal([NUM_CLASSES], seeds[2],
                                     stddev=_MIX_STDDEV)
    shift = tf.random.stateless_normal([IMAGE_SHAPE[-1]], seeds[3],
                                       stddev=_COLOUR_SHIFT_STDDEV)
    noise = tf.random.stateless_normal(IMAGE_SHAPE, seeds[4],
                                       stddev=_NOISE_STDDEV)
    signal = tf.roll(patterns[label], translation, axis=[0, 1])
    distractor = tf.tensordot(mix, patterns, axes=1)
    image = contrast * signal + distractor + shift + noise
    return image, label

  return example


def examples(split, num_parallel_calls=tf.data.AUTOTUNE):
  """Returns the unbatched examples of `split` in index order, one pass.

  Args:
    split: "train" or "test".
    num_parallel_calls: parallelism of the example generation.

  Returns:
    A `tf.data.Dataset` of (image float32 [32, 32, 3], label int32 []).

  Raises:
    ValueError: if `split` is unknown.
  """
  _check_split(split)
  return tf.data.Dataset.range(NUM_EXAMPLES[split]).map(
      _example_fn(split), num_parallel_calls=num_parallel_calls)


def dataset(split, batch_size, seed=0, num_parallel_calls=tf.data.AUTOTUNE,
            with_ids=False, exclude_ids=(), make_once=False):
  """Returns batches of `split`; train shuffles and repeats forever.

  An example's id is its index in the split (`examples(split)` yields it at
  that position).

  Args:
    split: "train" (shuffled with `seed`, reshuffled every epoch, repeated
      forever) or "test" (one pass in index order).
    batch_size: examples per batch; a partial last batch is dropped.
    seed: shuffle seed of the train split; it never changes the examples.
    num_parallel_calls: parallelism of the example generation.
    with_ids: whether the batches end with the examples' ids.
    exclude_ids: sorted int64 array (`example_ids.normalize`) of indices
      dropped before their examples are made; the others keep their order.
    make_once: (train) make every example of the split once, in index
      order, into a table kept in memory (123 MB for train), and gather each
      batch from it by its ids: the same batches, a few microseconds of CPU
      each instead of milliseconds, after a first batch that waits for the
      whole split (about 1.3 s of CPU). Worth it for a run that reads at
      least an epoch.

  Returns:
    A `tf.data.Dataset` of (images float32 [batch_size, 32, 32, 3], labels
    int32 [batch_size]), then ids int64 [batch_size] if `with_ids`.

  Raises:
    ValueError: if `split` is unknown.
  """
  _check_split(split)
  indices = tf.data.Dataset.range(NUM_EXAMPLES[split])
  if split == "train":
    indices = indices.shuffle(NUM_EXAMPLES[split], seed=seed,
                              reshuffle_each_iteration=True).repeat()
  if len(exclude_ids):
    indices = indices.filter(example_ids.keep_fn(exclude_ids))
  if make_once and split == "train":
    ds = _gathered(split, indices.batch(batch_size, drop_remainder=True),
                   num_parallel_calls, with_ids)
    return ds.prefetch(tf.data.AUTOTUNE)
  example = _example_fn(split)
  if with_ids:
    make = lambda index: example(index) + (index,)
  else:
    make = example
  ds = indices.map(make, num_parallel_calls=num_parallel_calls)
  return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def _gathered(split, id_batches, num_parallel_calls, with_ids):
  """`id_batches` made into batches gathered from the table of every
  example of `split` (made once, in index order: row i is example i)."""
  table = examples(split, num_parallel_calls).batch(
      NUM_EXAMPLES[split]).cache().repeat()

  def gather(ids, rows):
    images, labels = rows
    batch = (tf.gather(images, ids), tf.gather(labels, ids))
    return batch + (ids,) if with_ids else batch

  return tf.data.Dataset.zip((id_batches, table)).map(gather)
