"""What a training run left in its train_dir, read back for tests."""

import os

import tensorflow as tf

tf1 = tf.compat.v1


def scalars(train_dir, tag):
  """(step, value) of each summary `tag` in `train_dir`'s events, by step."""
  values = {}
  for path in tf1.gfile.Glob(os.path.join(train_dir, "events.*")):
    for event in tf1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          values[event.step] = value.simple_value
  return sorted(values.items())


def checkpoint_values(train_dir):
  """Every variable of `train_dir`'s latest checkpoint, by name."""
  reader = tf1.train.load_checkpoint(tf1.train.latest_checkpoint(train_dir))
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}
