"""A consumer's training script: a linear model, the wrapper, one bad batch.

Built in another workspace than tf1_safe_train's (see WORKSPACE): its only
dependency on it is `@tf1_safe_train//tf1_safe_train`. Prints the counters
after 5 steps, the third one fed a NaN: `applied 4 skipped 1`.
"""

import numpy as np
import tensorflow as tf
import tf1_safe_train

tf1 = tf.compat.v1


def main():
  tf1.disable_eager_execution()
  x = tf1.placeholder(tf.float32, [None, 3])
  y = tf1.placeholder(tf.float32, [None, 1])
  w = tf1.get_variable("w", [3, 1], initializer=tf1.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
  global_step = tf1.train.get_or_create_global_step()
  opt = tf1_safe_train.SkipNonFiniteOptimizer(
      tf1.train.AdamOptimizer(0.1))
  train_op = opt.minimize(loss, global_step=global_step)
  counters = tf1_safe_train.skip_counters()
  with tf1.train.MonitoredTrainingSession() as sess:
    for step in range(5):
      batch = np.ones([4, 3], np.float32)
      if step == 2:
        batch[1, 2] = np.nan
      sess.run(train_op, {x: batch, y: np.full([4, 1], 2.0, np.float32)})
    c, weights = sess.run([counters, w])
  print("consumer: applied %d skipped %d finite %s" % (
      c.applied_steps, c.skipped_steps, np.isfinite(weights).all()))


if __name__ == "__main__":
  main()
