"""Tests for float32 master weights under low-precision compute."""

from absl.testing import parameterized
import tensorflow as tf

from tf1_safe_train import models
from tf1_safe_train.trainer.step import precision

tf1 = tf.compat.v1


class PrecisionTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.parameters(("fp16", tf.float16), ("bf16", tf.bfloat16))
  def testMasterWeightsAreFloat32AndComputeIsLow(self, name, dtype):
    with tf.Graph().as_default():
      images = tf.cast(tf.random.normal([2, 32, 32, 3], seed=1), dtype)
      with precision.float32_master_weights():
        logits = models.get_model("resnet20")(images, is_training=True)
      self.assertEqual(logits.dtype, dtype)
      variables = tf1.trainable_variables()
      self.assertNotEmpty(variables)
      for v in variables:
        self.assertEqual(v.dtype.base_dtype, tf.float32, v.op.name)
      # The same names as in float32: checkpoints are interchangeable.
      self.assertIn("resnet20/initial/conv/weights",
                    [v.op.name for v in variables])
      loss = tf.reduce_mean(tf.cast(logits, tf.float32))
      grads = tf.gradients(loss, variables)
      for g, v in zip(grads, variables):
        self.assertEqual(g.dtype, tf.float32, v.op.name)
      convs = [op for op in tf1.get_default_graph().get_operations()
               if op.type == "Conv2D"]
      self.assertNotEmpty(convs)
      for op in convs:
        self.assertEqual(op.get_attr("T"), dtype.as_datatype_enum)
      with self.cached_session() as sess:
        sess.run(tf1.global_variables_initializer())
        self.assertAllEqual(sess.run(tf.math.is_finite(loss)), True)

  def testFloat32IsUnchanged(self):
    with tf.Graph().as_default():
      images = tf.zeros([2, 32, 32, 3])
      with precision.float32_master_weights():
        models.get_model("small_cnn")(images, is_training=True)
      casts = [op for op in tf1.get_default_graph().get_operations()
               if op.type == "Cast"]
      self.assertEmpty(casts)

  def testComputeDtype(self):
    self.assertEqual(precision.compute_dtype("fp16"), tf.float16)
    with self.assertRaisesRegex(ValueError, "fp8"):
      precision.compute_dtype("fp8")


if __name__ == "__main__":
  tf.test.main()
