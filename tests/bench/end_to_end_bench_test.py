"""`//bench:end_to_end --quick` runs end to end and reports what it promises.

Its main module runs forked (`forked_python`), as `python -m
bench.end_to_end --quick` would: `//:train` through `train_lib`, the
reference loop, its A/A copy and the other side variants, each timed in
every round, and the breakdown. The structure is checked, never the speed.
"""

import json
import os

import tensorflow as tf

from bench import end_to_end_lib
from bench import reference_loop
from tests.fixtures import forked_python


def tearDownModule():
  forked_python.close_shared()


def _main(args, cwd):
  code = "\n".join([
      "import runpy, sys",
      "sys.argv = %r" % (["end_to_end"] + list(args)),
      "runpy.run_module('bench.end_to_end', run_name='__main__', "
      "alter_sys=True)"])
  return forked_python.run_shared(code, cwd, timeout=300)


class EndToEndBenchTest(tf.test.TestCase):

  def testQuickRunTimesEveryVariantEveryRoundWithTheAAControl(self):
    json_out = os.path.join(self.get_temp_dir(), "end_to_end.json")
    result = _main(["--quick", "--json_out=" + json_out], self.get_temp_dir())
    self.assertEqual(0, result.returncode, result.stderr[-3000:])
    with open(json_out) as f:
      results = json.load(f)
    self.assertEqual(["small_cnn/1"], list(results["results"]))
    measured = results["results"]["small_cnn/1"]
    timing = measured["timing"]
    self.assertCountEqual(
        [end_to_end_lib.TRAIN] + list(end_to_end_lib.SIDE_VARIANTS), timing)
    for name, s in timing.items():
      self.assertEqual(2, s["blocks"], name)  # --quick: 2 rounds.
      self.assertGreater(s["cpu_ratio_to_baseline"], 0, name)
    self.assertEqual(1.0, timing[end_to_end_lib.REFERENCE]
                     ["ratio_to_baseline"])
    # The trainer's own hooks were timed, the savers among them.
    self.assertIn("CheckpointSaverHook", measured["hook_seconds_per_step"])
    self.assertIn("ProgressHook", measured["hook_seconds_per_step"])
    # Step stats of the trainer's step name its parts; the reference's
    # step is all model and optimizer.
    step_parts = measured["traces"][end_to_end_lib.STEP]["op_seconds"]
    self.assertIn("guard (checks, decision, counters)", step_parts)
    self.assertEqual(["model and optimizer"], list(
        measured["traces"][end_to_end_lib.REFERENCE]["op_seconds"]))
    lines = result.stdout.splitlines()
    self.assertTrue(any(line.startswith("| small_cnn/1 |") for line in lines))
    self.assertIn("A/A", result.stdout)
    self.assertIn("Breakdown small_cnn/1", result.stdout)

  def testReferenceRejectsAnUnknownVariableUpdate(self):
    with self.assertRaisesRegex(ValueError, "variable_update"):
      reference_loop.build("small_cnn", 1, 2, variable_update="horovod")

  def testReplicatedReferenceStartsEveryCopyFromTowerZeros(self):
    ref = reference_loop.build("small_cnn", 2, 2)
    with ref.session.graph.as_default():
      values = {v.op.name: ref.session.run(v)
                for v in tf.compat.v1.trainable_variables()}
    ref.session.close()
    copies = [(name, "v1/" + name[len("v0/"):]) for name in values
              if name.startswith("v0/")]
    self.assertNotEmpty(copies)
    for v0, v1 in copies:
      self.assertAllEqual(values[v0], values[v1])


if __name__ == "__main__":
  tf.test.main()
