"""One record per skip event, all excluded; skips/ bounded across runs.

The trainer runs in-process (issue 23, items 1 and 5): skips that recur at
one step (`increment_global_step_on_skip=False`) or that a restart re-runs
each keep their record and their own saved state, a restart excludes the
union of every reproducible record's ids and feeds none of them, and the
saved states of one train_dir stay within `max_explained_skips` however
many runs it sees, oldest pruned first, records kept.
"""

import os
import shutil
import tempfile

import tensorflow as tf

from tests.fixtures import forensics_params
from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.explain import offline_replay
from tf1_safe_train.trainer.explain import skip_states
from tf1_safe_train.trainer.run import train_lib

tf1 = tf.compat.v1


def _params(train_dir, **overrides):
  return forensics_params.params(train_dir,
                                    **dict(dict(num_towers=1), **overrides))


def _bad_ids(records):
  """The ids of the input rows each reproducible record names."""
  ids = set()
  for record in records:
    if record.get("reproduced"):
      ids |= set(record["replay"]["input_ids"])
  return ids


def _states(train_dir):
  return sorted(os.listdir(os.path.join(train_dir, skip_states.SKIPS_DIR)))


class SkipEventsTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One train_dir sees the three regressions' runs, each a graph built:
    # 1. three skips at step 2 (the step does not advance), then a give-up;
    # 2. after a crash before any checkpoint covered them, a rerun that
    #    skips at step 2 three times again (other examples), keeping the
    #    states of its newest two explained skips only;
    # 3. a restart, which must feed none of the examples of either run.
    train_dir = cls.train_dir = os.path.join(
        tempfile.mkdtemp(dir=tf1.test.get_temp_dir()), "runs")
    drill = dict(max_steps=6, increment_global_step_on_skip=False,
                 max_consecutive_skips=3, inject_nonfinite="nan@2:0",
                 inject_into="input")
    cls.first = train_lib.train(_params(train_dir, **drill))
    cls.first_records = skip_log.read(skip_log.path(train_dir))
    cls.first_states = _states(train_dir)
    # What a SIGKILL right after the records leaves: the records, no
    # checkpoint covering their step.
    for name in os.listdir(train_dir):
      if name.startswith(("model.ckpt", "checkpoint", "events")):
        os.remove(os.path.join(train_dir, name))
    cls.second = train_lib.train(_params(train_dir, max_explained_skips=2,
                                         **drill))
    cls.records = skip_log.read(skip_log.path(train_dir))
    cls.states = _states(train_dir)
    cls.fed = forensics_params.FedIds()
    cls.restart = train_lib.train(_params(train_dir, max_steps=12),
                                  extra_hooks=[cls.fed])

  def _dir(self, name):
    return os.path.join(self.get_temp_dir(), name)

  def assertRestartFedNoneOf(self, bad):
    """The fixture's restart excluded (and fed none of) the reproducible
    records' examples, `bad` among them."""
    every = _bad_ids(self.records)
    self.assertContainsSubset(bad, every)
    excluded = self.restart["forensics"]["excluded_examples"]
    self.assertEqual(excluded["count"], len(every))
    self.assertEqual(excluded["by_reason"], {"nonfinite_input": len(every)})
    self.assertNotEmpty(self.fed.ids)
    self.assertEmpty(self.fed.ids & every)

  # Regression test (issue 23, 1): four skips all at step 5 excluded the
  # examples of the last one only, and overwrote skips/step-5/.
  def testRepeatedStepKeepsEveryRecordAndExcludesTheirUnion(self):
    self.assertEqual(self.first["exit_reason"], "too_many_consecutive_skips")
    records = self.first_records
    self.assertEqual([r["step"] for r in records], [2, 2, 2])
    self.assertTrue(all(r["reproduced"] for r in records))
    bad = _bad_ids(records)
    self.assertLen(bad, 12)  # 3 batches of 4, each poisoned whole.
    self.assertEqual(self.first_states, ["step-2-1", "step-2-2", "step-2-3"])
    self.assertLen(set(r["state_dir"] for r in records), 3)
    self.assertRestartFedNoneOf(bad)

  # Regression test (issue 23, 1): a skip, a crash before a checkpoint
  # covered it, a rerun that skips at that step again: the next restart
  # excluded only the second record's examples.
  def testRerunAfterACrashKeepsBothRecordsAndExcludesBoth(self):
    self.assertEqual(self.second["exit_reason"], "too_many_consecutive_skips")
    records = self.records
    self.assertEqual([r["step"] for r in records], [2] * 6)
    self.assertEqual(records[:3], self.first_records)  # Kept as they were.
    first, second = (set(i for r in run for i in r["towers"][0][
        "example_ids"]) for run in (records[:3], records[3:]))
    self.assertLen(second, 12)
    self.assertEmpty(first & second)  # The rerun did not feed them again.
    self.assertEqual([r["state_dir"] for r in records[3:5]],
                     [os.path.join("skips", "step-2-%d" % k) for k in (4, 5)])
    self.assertRestartFedNoneOf(_bad_ids(records[:3]) | _bad_ids(records[3:]))

  # Regression test (issue 23, 5): skips/ grew by max_explained_skips
  # states per run, never pruned.
  def testSavedStatesStayBoundedAcrossRuns(self):
    records = self.records  # The second run's, with --max_explained_skips=2.
    self.assertLen(records, 6)  # Records are kept.
    kept = [r for r in records if r.get("state_dir") and os.path.isdir(
        os.path.join(self.train_dir, r["state_dir"]))]
    # The newest two explained skips (the second run's) keep their states;
    # the first run's are pruned.
    self.assertEqual(kept, records[3:5])
    self.assertEqual(self.states, sorted(
        os.path.basename(r["state_dir"]) for r in kept))

  def testOldStateDirsAreReadAndPrunedFirst(self):
    train_dir = self._dir("old")
    os.makedirs(os.path.join(train_dir, "skips", "step-9"))
    self.assertEqual(os.path.basename(skip_states.new_dir(train_dir, 3)),
                     "step-3-1")
    self.assertEqual(skip_states.prune(train_dir, 1), ["step-9"])
    shutil.rmtree(os.path.join(train_dir, "skips"))
    # A name a record still names is not reused.
    skip_log.append(skip_log.path(train_dir), dict(
        step=3, worker=0, time=0.0, reason="nonfinite", towers=[],
        state_dir=os.path.join("skips", "step-3-1")))
    self.assertEqual(os.path.basename(skip_states.new_dir(train_dir, 3)),
                     "step-3-2")
    self.assertEqual(os.path.basename(skip_states.new_dir(train_dir, 3, 1)),
                     "worker1-step-3-1")

  def testReplayPicksTheNewestRecordOfAStepOrTheOneAsked(self):
    train_dir = self._dir("pick")
    log = skip_log.path(train_dir)
    os.makedirs(train_dir)
    for k in (1, 2):
      skip_log.append(log, dict(
          step=3, worker=0, time=float(k), reason="nonfinite", towers=[],
          state_dir=os.path.join("skips", "step-3-%d" % k)))
    self.assertEqual(offline_replay.find_record(train_dir, 3)["time"], 2.0)
    self.assertEqual(offline_replay.find_record(train_dir, 3, number=1)[
        "time"], 1.0)
    with self.assertRaisesRegex(offline_replay.ReplayError,
                                "records 2 skip\\(s\\) of step 3, not 3"):
      offline_replay.find_record(train_dir, 3, number=3)
    with self.assertRaisesRegex(offline_replay.ReplayError, "pruned"):
      offline_replay.replay_recorded(train_dir, 3)


if __name__ == "__main__":
  tf.test.main()
