"""What the in-process forensics tests share: small params, the ids fed."""

import tensorflow as tf

from tf1_safe_train.trainer import params as params_lib

tf1 = tf.compat.v1


def params(train_dir, **overrides):
  """Validated TrainParams of a short CPU run that saves almost nothing."""
  values = dict(train_dir=train_dir, num_towers=2, device="cpu", batch_size=4,
                max_steps=4, save_checkpoints_steps=1000,
                save_summaries_steps=1000, log_every_n_steps=1000)
  values.update(overrides)
  return params_lib.TrainParams(**values).validate()


class FedIds(tf1.train.SessionRunHook):
  """Every example id the towers read (from the batch store)."""

  def __init__(self):
    self.ids = set()

  def begin(self):
    self._reads = [v.read_value() for v in tf1.local_variables()
                   if v.name.startswith("batch_store/") and
                   v.name.endswith("/ids:0")]

  def after_run(self, run_context, run_values):
    for ids in run_context.session.run(self._reads):  # After the step.
      self.ids.update(int(i) for i in ids)
