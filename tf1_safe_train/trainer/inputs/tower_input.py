"""The towers' input: batches with example ids, each kept for a skip.

`TowerInput` makes the run's input pipeline (with example ids, without the
excluded examples) and, per tower, reads a batch, applies the input drill
and stores the batch as the model reads it (`batch_store`), all on the
input's device, so keeping the batch copies nothing across devices.

The iterator is read inside a `tf.cond` on the store's `replaying` flag: a
replay (which feeds the flag True and its batch) can never pull a batch
through the training iterator. Feeding the iterator's outputs is not
enough: Grappler folds shapes of the batch into constants with a control
edge from the op that made it, so a fed `IteratorGetNext` still runs and
consumes a batch no step trains on.
"""

import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train.trainer.inputs import batch_store

tf1 = tf.compat.v1

INPUT_DEVICE = "/device:CPU:0"
# Each tower's example ids tensor of the step (what a rollback's window
# keeps: `checkpoint_rollback_window`).
EXAMPLE_IDS_COLLECTION = "tf1_safe_train_example_ids"


def reads_an_epoch(params):
  """Whether a run of `params` reads at least as many examples as its
  synthetic train split holds: then making each example once, up front
  (`synthetic.dataset`'s `make_once`), costs less than making each batch's
  (a short run, e.g. a test's, would wait for the whole split)."""
  return (params.dataset == "synthetic" and
          params.max_steps * params.batch_size * params.num_towers >=
          data.num_examples("synthetic", "train"))


def _iterator(params, worker_index, dataset_fn, exclude_ids, skip_batches):
  """The iterator of (images, labels, example ids) batches, past the first
  `skip_batches` (read by an earlier segment of the process: `segments`)."""
  with tf.device(INPUT_DEVICE), tf1.name_scope("input"):
    # Each worker of a cluster shuffles its own way (worker 0 as alone).
    seed = params.seed + worker_index
    if dataset_fn is None:
      dataset = data.get_dataset(params.dataset, "train", params.batch_size,
                                 data_dir=params.data_dir, seed=seed,
                                 with_ids=True, exclude_ids=exclude_ids,
                                 make_once=reads_an_epoch(params))
    else:
      dataset = data.exclude(data.with_ids(dataset_fn(params.batch_size,
                                                       seed)),
                             exclude_ids, params.batch_size)
    if skip_batches:
      dataset = dataset.skip(skip_batches)
    return tf1.data.make_one_shot_iterator(dataset)


class TowerInput(object):
  """The input of a worker's towers and the store of their last batches.

  Attributes:
    store: the `batch_store.BatchStore`.
  """

  def __init__(self, params, worker_index, num_towers, dataset_fn=None,
               exclude_ids=(), skip_batches=0):
    self._iterator = _iterator(params, worker_index, dataset_fn, exclude_ids,
                               skip_batches)
    self._first = None
    with tf.device(INPUT_DEVICE):
      self.store = batch_store.BatchStore(self._iterator.element_spec,
                                          num_towers)

  def read(self, tower, tower_drill):
    """Tower `tower`'s (images, labels), as its model reads them.

    The input drill poisons the batch here: it models data, so the store
    (and a replay) keep the poisoned batch.
    """
    def next_batch():
      images, labels, ids = self._iterator.get_next()
      images = tower_drill.input(images)
      # The outputs wait for the store: a skip reads this step's batch.
      with tf1.control_dependencies([self.store.write(tower, images, labels,
                                                      ids)]):
        return tf.identity(images), tf.identity(labels), tf.identity(ids)

    with tf.device(INPUT_DEVICE):
      images, labels, ids = tf.cond(self.store.replaying,
                                    lambda: self.store.values(tower),
                                    next_batch, name="batch")
      tf1.add_to_collection(EXAMPLE_IDS_COLLECTION, ids)
    if self._first is None:  # The first tower built (see `towers`).
      self._first = (images, labels, ids)
    return images, labels

  def keep_if_applied(self, applied, step):
    """The op keeping tower 0's batch of `step` if `applied` (a replay's
    control batch: `batch_store`); group it into the train op."""
    with tf.device(INPUT_DEVICE):
      return self.store.keep_if_applied(applied, step, *self._first)
