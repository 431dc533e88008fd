import tensorflow as tf


class SmokeTest(tf.test.TestCase):

  def testImports(self):
    self.assertTrue(tf.__version__.startswith("2."))
