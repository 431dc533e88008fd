"""What a training run left in its train_dir, read back for tests."""

import json
import os

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

# run_summary.RUN_SUMMARY, without importing the trainer.
RUN_SUMMARY = "run_summary.json"


def scalars(train_dir, tag):
  """(step, value) of each summary `tag` in `train_dir`'s events, by step."""
  values = {}
  for path in tf1.gfile.Glob(os.path.join(train_dir, "events.*")):
    for event in tf1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          values[event.step] = value.simple_value
  return sorted(values.items())


def read_run_summary(train_dir):
  with open(os.path.join(train_dir, RUN_SUMMARY)) as f:
    return json.load(f)


def checkpoint_paths(train_dir):
  """The complete checkpoints the `checkpoint` state file lists, oldest first."""
  state = tf1.train.get_checkpoint_state(train_dir)
  if state is None:
    return []
  return [p if os.path.isabs(p) else os.path.join(train_dir, p)
          for p in state.all_model_checkpoint_paths]


def latest_checkpoint(train_dir):
  return tf1.train.latest_checkpoint(train_dir)


def checkpoint_values(path):
  """Every entry of the checkpoint at `path` (a train_dir: its latest), as
  numpy values, by name."""
  if os.path.isdir(path):
    path = latest_checkpoint(path)
  reader = tf1.train.load_checkpoint(path)
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}


def nonfinite_entries(values):
  """Names of the floating entries of `values` holding a NaN or an Inf."""
  bad = []
  for name, value in sorted(values.items()):
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
      bad.append(name)
  return bad


def files_snapshot(directory):
  """{relative path: bytes} of every file under `directory`."""
  snapshot = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        snapshot[os.path.relpath(path, directory)] = f.read()
  return snapshot


def assert_rollback_checkpoints(test, train_dir):
  """Asserts a rollback run's checkpoints are finite, their counts add up
  (global_step = applied + skipped + rolled back) and global_step only
  grows; returns [(path, values)] in step order."""
  checked = []
  for path in checkpoint_paths(train_dir):
    values = checkpoint_values(path)
    test.assertEqual(nonfinite_entries(values), [], path)
    test.assertEqual(int(values["global_step"]),
                     int(values["applied_steps"]) +
                     int(values["skipped_steps"]) +
                     int(values["rolled_back_steps"]), path)
    checked.append((path, values))
  steps = [int(values["global_step"]) for _, values in checked]
  test.assertEqual(steps, sorted(steps))
  return checked
