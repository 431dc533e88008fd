"""Evaluation of the latest checkpoint: precision@1 and loss on the test split.

Weights come from the exponential moving average when the checkpoint holds one
(`--moving_average_decay` > 0 at training time), as in the classic TF1
cifar10_eval. A checkpoint the trainer prunes between its choice and its
restore is replaced by the newest; one holding a non-finite value is refused,
and so is a loss that is not finite (finite weights a run wrecked).
"""

import os

from absl import logging
import numpy as np
import tensorflow as tf

from tf1_safe_train import data
from tf1_safe_train import models
from tf1_safe_train.trainer.checkpoint import checkpoints
from tf1_safe_train.trainer.config import params as params_lib

tf1 = tf.compat.v1

_EMA_SUFFIX = "/ExponentialMovingAverage"


_ATTEMPTS = 3


class NoCheckpointError(ValueError):
  """The train directory holds no checkpoint."""


class NonFiniteCheckpointError(ValueError):
  """The checkpoint's weights hold a NaN or an Inf; the message names them."""


class NonFiniteLossError(ValueError):
  """Finite weights whose loss is NaN or Inf on test examples: a wrecked
  model is not a result; the message says how many and what to do."""


def _restore_map(checkpoint, variables):
  """Maps checkpoint names to `variables`, preferring EMA shadows."""
  available = set(name for name, _ in tf1.train.list_variables(checkpoint))
  mapping, used_ema = {}, False
  for v in variables:
    name = v.op.name
    if name + _EMA_SUFFIX in available:
      mapping[name + _EMA_SUFFIX] = v
      used_ema = True
    else:
      mapping[name] = v
  return mapping, used_ema


def evaluate(params):
  """Evaluates the latest checkpoint of `params.train_dir`.

  Args:
    params: validated `params.EvalParams`.

  Returns:
    A dict: precision_at_1, loss, num_examples, nonfinite_examples (0),
    global_step, checkpoint, used_ema.

  Raises:
    NoCheckpointError: if `train_dir` has no checkpoint.
    params.ParamsError: if the batch is larger than the test split.
    NonFiniteCheckpointError: if a weight of the checkpoint is not finite.
    NonFiniteLossError: if the loss of some test example is not finite.
  """
  params.validate()
  _check_batch_size(params)
  for attempt in range(_ATTEMPTS):
    checkpoint = checkpoints.latest(params.train_dir)
    if checkpoint is None:
      raise NoCheckpointError("no checkpoint in --train_dir=%s" %
                              params.train_dir)
    try:
      result = _evaluate(params, checkpoint)
      break
    except (tf.errors.OpError, ValueError) as e:
      # A running trainer prunes old checkpoints: the one chosen may be gone
      # (or half-deleted) by the time it is read. Anything else is an error.
      if (isinstance(e, NonFiniteCheckpointError) or
          attempt + 1 == _ATTEMPTS or checkpoints.damage(checkpoint) is None):
        raise
      logging.warning("%s went away before it was restored (pruned by the "
                      "trainer?): evaluating the newest checkpoint instead",
                      checkpoint)
  if result["nonfinite_examples"]:
    raise NonFiniteLossError(
        "%s (step %d): the loss is NaN or Inf on %d of %d test examples: "
        "its weights are finite but wrecked (e.g. by a learning rate that "
        "overflowed); evaluate a checkpoint written before the run's skips "
        "began (skips.jsonl lists them)" % (
            result["checkpoint"], result["global_step"],
            result["nonfinite_examples"], result["num_examples"]))
  _write_summary(os.path.join(params.train_dir, "eval"), result)
  return result


def _check_batch_size(params):
  """Refuses a batch larger than the test split: no full batch exists (the
  partial last batch is dropped), so nothing would be evaluated."""
  available = data.num_examples(params.dataset, "test", params.data_dir)
  if params.batch_size > available:
    raise params_lib.ParamsError(
        "--batch_size=%d exceeds the %d examples of the %s test split: use "
        "--batch_size=%d or less" % (params.batch_size, available,
                                     params.dataset, available))


def _check_finite(checkpoint, mapping):
  """Raises NonFiniteCheckpointError if a restored value is not finite."""
  reader = tf1.train.NewCheckpointReader(checkpoint)
  bad = []
  for name in sorted(mapping):
    value = reader.get_tensor(name)
    if (np.issubdtype(np.asarray(value).dtype, np.floating) and
        not np.isfinite(value).all()):
      bad.append(name)
  if bad:
    raise NonFiniteCheckpointError(
        "%s holds non-finite values in %s: its weights are unusable (a run "
        "before the finite-state check wrote it); evaluate a run whose "
        "checkpoints are finite" % (
            checkpoint, ", ".join(bad[:5]) +
            (" (+%d more)" % (len(bad) - 5) if len(bad) > 5 else "")))


def _evaluate(params, checkpoint):
  """Evaluates `checkpoint`; returns the result dict of `evaluate`."""
  with tf.Graph().as_default():
    dataset = data.get_dataset(params.dataset, "test", params.batch_size,
                               data_dir=params.data_dir)
    images, labels = tf1.data.make_one_shot_iterator(dataset).get_next()
    logits = models.get_model(params.model)(
        images, is_training=False, num_classes=data.NUM_CLASSES)
    labels = tf.cast(labels, tf.int32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    loss = tf.reduce_sum(losses)
    nonfinite = tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(
        losses)), tf.int64))
    correct = tf.reduce_sum(tf.cast(tf.nn.in_top_k(
        predictions=logits, targets=labels, k=1), tf.int64))
    mapping, used_ema = _restore_map(checkpoint, tf1.global_variables())
    _check_finite(checkpoint, mapping)
    saver = tf1.train.Saver(var_list=mapping)
    total_correct, total_loss, total, total_nonfinite = 0, 0.0, 0, 0
    with tf1.Session() as session:
      saver.restore(session, checkpoint)
      while not params.max_examples or total < params.max_examples:
        try:
          batch_correct, batch_loss, batch_nonfinite = session.run(
              [correct, loss, nonfinite])
        except tf.errors.OutOfRangeError:
          break
        total_correct += int(batch_correct)
        total_loss += float(batch_loss)
        total_nonfinite += int(batch_nonfinite)
        total += params.batch_size
  global_step = int(tf1.train.load_checkpoint(checkpoint).get_tensor(
      "global_step"))
  return {
      "precision_at_1": total_correct / float(max(total, 1)),
      "loss": total_loss / float(max(total, 1)),
      "num_examples": total,
      "nonfinite_examples": total_nonfinite,
      "global_step": global_step,
      "checkpoint": checkpoint,
      "used_ema": used_ema,
  }


def _write_summary(eval_dir, result):
  """Writes TensorBoard's eval scalars to `eval_dir` if it can.

  Evaluation reads the train_dir; writing is a convenience. An archived run
  (a read-only disk or directory) is evaluated all the same, with one line
  saying the scalars were not written (and nothing written there).
  """
  parent = os.path.dirname(eval_dir)
  writable = os.access(eval_dir if os.path.isdir(eval_dir) else parent,
                       os.W_OK)
  problem = None if writable else "not writable"
  if writable:
    try:
      _write_scalars(eval_dir, result)
    except (OSError, tf.errors.OpError) as e:
      problem = str(e).strip().splitlines()[-1] if str(e).strip() else (
          type(e).__name__)
  if problem:
    logging.warning("eval scalars for TensorBoard not written to %s (%s); "
                    "the evaluation is complete", eval_dir, problem)


def _write_scalars(eval_dir, result):
  with tf.Graph().as_default():
    writer = tf1.summary.FileWriter(eval_dir)
    writer.add_summary(tf1.Summary(value=[
        tf1.Summary.Value(tag="eval/precision_at_1",
                          simple_value=result["precision_at_1"]),
        tf1.Summary.Value(tag="eval/loss", simple_value=result["loss"]),
    ]), result["global_step"])
    writer.close()
