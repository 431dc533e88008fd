"""Parameters: validation, their flag declarations, and the name lists they
share with the modules that implement each name."""

import dataclasses

import tensorflow as tf

from tf1_safe_train.core import checks
from tf1_safe_train import data
from tf1_safe_train import models
from tf1_safe_train.trainer.config import flag_specs
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.step import precision
from tf1_safe_train.trainer.tower import towers


class ParamsTest(tf.test.TestCase):

  def testSyncReplicasNeedsGlobalStepOnSkip(self):
    with self.assertRaisesRegex(params_lib.ParamsError,
                                "--sync_replicas needs"):
      params_lib.TrainParams(sync_replicas=True,
                             increment_global_step_on_skip=False).validate()

  def testWorkerUnitNeedsSyncReplicas(self):
    with self.assertRaisesRegex(params_lib.ParamsError,
                                "--skip_unit=worker needs --sync_replicas"):
      params_lib.TrainParams(skip_unit="worker").validate()
    with self.assertRaisesRegex(params_lib.ParamsError,
                                "--min_healthy_workers=-1"):
      params_lib.TrainParams(skip_unit="worker", sync_replicas=True,
                             min_healthy_workers=-1).validate()
    params_lib.TrainParams(skip_unit="worker", sync_replicas=True,
                           min_healthy_workers=2).validate()

  def testStartupTimeoutMustBePositive(self):
    with self.assertRaisesRegex(params_lib.ParamsError,
                                "--startup_timeout_secs=0"):
      params_lib.TrainParams(startup_timeout_secs=0).validate()

  def testLossScaleHysteresisIsAnIntegerOfAtLeastOne(self):
    for bad in (0, -2, 1.5, True):
      with self.subTest(value=bad):
        with self.assertRaisesRegex(
            params_lib.ParamsError,
            r"^--loss_scale_hysteresis=%r: must be an integer >= 1 [^\n]*$"
            % (bad,)):
          params_lib.TrainParams(loss_scale_hysteresis=bad).validate()
    params_lib.TrainParams(loss_scale_hysteresis=3).validate()

  def testBooleansAreNotIntegers(self):
    self.assertTrue(checks.is_int(3))
    self.assertFalse(checks.is_int(True))
    self.assertFalse(checks.is_int(3.0))
    self.assertTrue(checks.is_number(0.5))
    self.assertFalse(checks.is_number(False))
    for field in ("num_towers", "batch_size", "max_steps", "seed"):
      with self.subTest(field=field):
        with self.assertRaisesRegex(params_lib.ParamsError,
                                    "--%s=True" % field):
          params_lib.TrainParams(**{field: True}).validate()
    with self.assertRaisesRegex(params_lib.ParamsError, "--max_examples=True"):
      params_lib.EvalParams(max_examples=True).validate()


class NameListsTest(tf.test.TestCase):
  """params.py cannot import the TensorFlow modules, so the lists are tied."""

  def testModelsAndDatasets(self):
    self.assertCountEqual(params_lib.MODELS, models.MODEL_NAMES)
    self.assertCountEqual(params_lib.DATASETS, data.DATASET_NAMES)

  def testPrecisions(self):
    self.assertCountEqual(params_lib.PRECISIONS, precision.PRECISIONS)

  def testDevicesAreWhatTowersAccept(self):
    for device in params_lib.DEVICES:
      self.assertEqual(towers.TowerConfig(device_type=device).device_type,
                       device)
    with self.assertRaises(ValueError):
      towers.TowerConfig(device_type="tpu")


class FlagDeclarationsTest(tf.test.TestCase):

  def testEveryFieldDeclaresItsFlag(self):
    for params_class in (params_lib.TrainParams, params_lib.EvalParams):
      specs = flag_specs.of_params(params_class)
      self.assertEqual([s.name for s in specs],
                       [f.name for f in dataclasses.fields(params_class)])
      for spec in specs:
        with self.subTest(flag=spec.name):
          self.assertTrue(spec.help)

  def testMachineDependentDefaultsAreDecidedAtRunTime(self):
    specs = {s.name: s for s in flag_specs.of_params(params_lib.TrainParams)}
    self.assertIsNone(specs["num_towers"].default)
    self.assertIn("default: every visible GPU, or 2", specs["num_towers"].help)
    self.assertEqual(specs["device"].default, "auto")
    self.assertEqual(specs["device"].choices,
                     ("auto",) + params_lib.DEVICES)
    self.assertEqual(specs["device"].kind, "enum")
    self.assertEqual(specs["max_steps"].kind, "integer")
    self.assertEqual(specs["sync_replicas"].kind, "boolean")

  def testTheSummaryPeriodSaysTheSkipCountersAreNotSampled(self):
    # Issue #37: the skips/ counters are written on every change
    # (`step_summaries.CountersHook`), whatever --save_summaries_steps.
    specs = {s.name: s for s in flag_specs.of_params(params_lib.TrainParams)}
    help_text = specs["save_summaries_steps"].help
    self.assertIn("skips/", help_text)
    self.assertIn("on every step that changes one", help_text)
    self.assertIn("regardless", help_text)


if __name__ == "__main__":
  tf.test.main()
