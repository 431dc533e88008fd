"""A replay never consumes training input (docs/forensics.md).

A skip's replay feeds the batch the batch store kept; it must never pull a
batch through the training iterator, or the run silently loses that batch
(no step trains on it, no record names it). Checked two ways: a replay's
RunMetadata trace runs no `IteratorGetNext`, and a run whose every other
step is a replayed skip is fed each example of an epoch exactly once.
"""

import os

import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train.trainer.run import local_replication
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.inputs import tower_input
from tf1_safe_train.trainer.run import train_lib
from tf1_safe_train.trainer.step import train_step

tf1 = tf.compat.v1


class _FedIds(tf1.train.SessionRunHook):
  """The example ids each step's towers read, in order."""

  def __init__(self):
    self.steps = []

  def begin(self):
    self._ids = tf1.get_collection(tower_input.EXAMPLE_IDS_COLLECTION)

  def before_run(self, run_context):
    return tf1.train.SessionRunArgs(self._ids)

  def after_run(self, run_context, run_values):
    self.steps.append([int(i) for ids in run_values.results for i in ids])


class ReplayInputTest(tf.test.TestCase):

  def testReplayRunsNoIteratorOp(self):
    params = params_lib.TrainParams(
        train_dir=self.get_temp_dir(), num_towers=2, device="cpu",
        batch_size=4, inject_nonfinite="nan@0:1").validate()
    with tf.Graph().as_default():
      strategy = local_replication.Local(params)
      with strategy.device():
        step = train_step.build_step(params, strategy)
      forensics = step.forensics
      with tf1.Session(config=tf1.ConfigProto(
          device_count={"CPU": 2})) as session:
        session.run([tf1.global_variables_initializer(),
                     tf1.local_variables_initializer()])
        session.run(step.train_op)
        batch = forensics.store.read(session, 1)
        metadata = tf1.RunMetadata()
        options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
        for tower in forensics.towers:  # Its own and the other's graph.
          # As replay_lib feeds a replay.
          feed = {forensics.store.replaying: True, tower.images: batch[0],
                  tower.labels: batch[1]}
          feed.update(tower.fault_feeds)
          flags = tower.probe._flags  # pylint: disable=protected-access
          session.run(flags, feed, options=options, run_metadata=metadata)
          ran = [n.node_name for d in metadata.step_stats.dev_stats
                 for n in d.node_stats]
          self.assertNotEmpty(ran)
          self.assertEqual([n for n in ran if "IteratorGetNext" in n], [])

  def testEveryExampleOfAnEpochIsFedOnceWithReplays(self):
    # An epoch of 200 examples (the synthetic test split's first, with their
    # ids), repeated: ten steps of 20 read it once, whatever the replays.
    batch_size, steps = 20, 10
    epoch = batch_size * steps

    def dataset_fn(unused_batch_size, unused_seed):
      return data.get_dataset("synthetic", "test", batch_size,
                              with_ids=True).take(steps).repeat()

    skipped = list(range(1, steps, 2))  # Every other step, each replayed.
    fed = _FedIds()
    summary = train_lib.train(params_lib.TrainParams(
        train_dir=os.path.join(self.get_temp_dir(), "epoch"), num_towers=1,
        device="cpu", batch_size=batch_size, max_steps=steps,
        inject_nonfinite=",".join("nan@%d" % s for s in skipped),
        max_explained_skips=len(skipped), max_consecutive_skips=0,
        save_checkpoints_steps=1000, save_summaries_steps=1000,
        log_every_n_steps=1000).validate(), extra_hooks=[fed],
                              dataset_fn=dataset_fn)
    self.assertEqual(summary["forensics"]["explained_skips"], len(skipped))
    self.assertEqual(summary["skipped_steps"], len(skipped))
    ids = [i for step in fed.steps for i in step]
    self.assertLen(fed.steps, steps)
    self.assertEqual(sorted(ids), list(range(epoch)))

if __name__ == "__main__":
  tf.test.main()
