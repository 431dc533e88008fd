"""`checkpoints.FiniteSaver` writes every checkpoint's `.meta` from one
serialisation of a finalized graph (what a save cost, `//bench:end_to_end`)."""

import os
from unittest import mock

import tensorflow as tf

from tf1_safe_train.trainer.checkpoint import checkpoints
from tf1_safe_train.trainer.checkpoint import finite_state

tf1 = tf.compat.v1


class MetaGraphTest(tf.test.TestCase):

  def _saves(self, finalize, steps=(1, 2, 3)):
    """(times the graph was serialised, each step's .meta MetaGraphDef)."""
    prefix = os.path.join(self.get_temp_dir(), "finalize_%s" % finalize,
                          "model.ckpt")
    with tf.Graph().as_default() as graph:
      tf1.Variable([1.0, 2.0], name="v")
      saver = checkpoints.FiniteSaver(finite_state.FiniteStateCheck(),
                                      lambda step, names: None)
      init = tf1.global_variables_initializer()
      if finalize:
        graph.finalize()
      original = tf1.train.Saver.export_meta_graph
      with mock.patch.object(tf1.train.Saver, "export_meta_graph",
                             autospec=True,
                             side_effect=original) as export, \
          tf1.Session() as session:
        session.run(init)
        for step in steps:
          saver.save(session, prefix, global_step=step)
      metas = {}
      for step in steps:
        meta = tf1.MetaGraphDef()
        with tf.io.gfile.GFile("%s-%d.meta" % (prefix, step), "rb") as f:
          meta.ParseFromString(f.read())
        metas[step] = meta
    return export.call_count, metas

  def testFinalizedGraphIsSerialisedOnceAndEveryCheckpointHasItsMeta(self):
    # Before: the graph was serialised again for each checkpoint (3 calls).
    calls, metas = self._saves(finalize=True)
    self.assertEqual(1, calls)
    for meta in metas.values():
      self.assertEqual(metas[1], meta)
      self.assertIn("v", [n.name for n in meta.graph_def.node])
      self.assertEqual(meta.saver_def, metas[1].saver_def)

  def testGraphStillBeingBuiltIsSerialisedEachTime(self):
    calls, metas = self._saves(finalize=False)
    self.assertEqual(3, calls)
    self.assertLen(metas, 3)


if __name__ == "__main__":
  tf.test.main()
