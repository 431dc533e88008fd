"""What a restart and a rollback do with each piece of a run's state.

One list (`RULES`): history (what happened: never rolled back, kept across
restarts), model state (what the model holds: restored by a rollback, as by
a restart), and what a restart rebuilds. `checkpoint_rollback.RollbackHook`
restores every variable but the ones `kept_on_rollback` names, and refuses
to build if a counter of the step is in no rule; docs/trainer.md's table
("What a restart and a rollback keep") is this list, word for word
(`tests/trainer/recovery/checkpoint_rollback_test.py::StateRulesTest`). A restart
applies the same rules as the run that wrote the state: the history is in
every checkpoint.
"""

import collections

import tensorflow as tf

from tf1_safe_train.core import criteria

tf1 = tf.compat.v1

Rule = collections.namedtuple("Rule", [
    "state", "names", "restart", "rollback", "test"])
Rule.__doc__ = """One piece of a run's state and what happens to it.

Attributes:
  state: what it is (the docs' words).
  names: its checkpoint variables' names (those a rollback keeps when its
    `rollback` starts with "kept" or "reset"), or () for state that is no
    variable.
  restart: what a restarted process does with it.
  rollback: what a rollback does with it.
  test: the tests that prove it (file::Class::test).
"""

# The counters a skip reason's criterion adds (`criteria.counter`, e.g.
# spike_skips) are named by the collection, not here.
_REASON_COUNTERS = "<reason>_skips"

_RUN = "trainer/recovery/checkpoint_rollback_test.py::RollbackRunTest::"
_ROLLED_BACK = _RUN + "testRollsBackOnceSkipsTheWindowAndFinishes"
_RESTART = _RUN + "testARestartNeverFeedsTheWindowAgain"
_THIRD = _RUN + "testAThirdRollbackGoesBackPastTheFirstsCheckpoint"
_TOWERS = ("e2e/reliability_rollback_test.py::TowerHistoryRollbackTest::"
           "testTheTowersCountsSurviveTheRollback")
_RERUN = ("e2e/reliability_rollback_test.py::TowerHistoryRollbackTest::"
          "testARerunOfTheFinishedRunKeepsTheRollbackFields")
_GAVE_UP = ("e2e/reliability_rollback_test.py::SigkillAtRollbackTest::"
            "testSigkillAtAndAfterTheRollbackThenResumeToTheEnd")
_SYNC = "cluster/sync_rollback_test.py::SyncRollbackTest::"
_SYNC_MODEL = _SYNC + "testTheRestoredModelIsTheCheckpointsOnTheParameterServers"
_SYNC_WINDOW = _SYNC + "testEveryWorkerTrainsOnPastTheWindow"
_OUTLIERS = ("trainer/tower/tower_unit_test.py::OutlierTowerTest::"
             "testItsCountIsHistoryKeptOnRollback")
_ACROSS = "trainer/tower/quarantine_test.py::AcrossRestartsTest::"
_QUARANTINE_RESTART = _ACROSS + "testADecisionOutlivesASigkillRightAfterItsLine"
_QUARANTINE_FLOOR = _ACROSS + "testARestartKeepsMinHealthyTowers"
_WORKER_QUARANTINE = (
    "cluster/worker_quarantine_test.py::WorkerQuarantineClusterTest::"
    "testQuarantinedAfterTwoUnreproducedFaultsAndKeptByARestart")
_REBUILT_INPUT = _ACROSS + "testTheRebuiltInputFeedsNoExampleTwice"
_SIGNAL_REBUILD = _ACROSS + "testASigtermDuringTheRebuildStopsTheRun"

RULES = (
    Rule("the model: weights, optimizer slots, moving statistics, shadows, "
         "EMA, loss scale, spike and tower-agreement statistics", (),
         "restored", "restored (the older checkpoint's; in a sync cluster "
         "onto the parameter servers, between an update and its tokens)",
         (_ROLLED_BACK, _SYNC_MODEL)),
    Rule("`applied_steps` (the updates the model holds)", ("applied_steps",),
         "restored", "restored (the undone ones counted in "
         "`rolled_back_steps`)", (_ROLLED_BACK,)),
    Rule("`global_step` (batches consumed: only grows)", ("global_step",),
         "kept", "kept (history; in a sync cluster it keeps the gradient "
         "accumulators dropping what was pushed before the rollback)",
         (_ROLLED_BACK, _SYNC_MODEL)),
    Rule("`skipped_steps` and each reason's count (`<reason>_skips`)",
         ("skipped_steps", _REASON_COUNTERS), "kept", "kept (history)",
         (_ROLLED_BACK,)),
    Rule("`nonfinite_steps_by_tower`, `max_consecutive_skips_seen`",
         ("nonfinite_steps_by_tower", "max_consecutive_skips_seen"),
         "kept", "kept (history)", (_TOWERS,)),
    Rule("`rejected_by_tower` (`--skip_unit=tower`), `rejected_by_worker` "
         "(`--skip_unit=worker`)", ("rejected_by_tower", "rejected_by_worker"),
         "kept", "kept (history)", (_TOWERS,)),
    Rule("`tower_outlier_by_tower` (`--skip_tower_outliers`)",
         ("tower_outlier_by_tower",), "kept", "kept (history)",
         (_OUTLIERS,)),
    Rule("`suspect_faults_by_tower` and the quarantined towers "
         "(`--quarantine_after`; the decision in `quarantine.json`, "
         "written before its line)", ("suspect_faults_by_tower",),
         "kept (history), judged again under the same K and floor",
         "kept (history)",
         (_TOWERS, _QUARANTINE_RESTART, _QUARANTINE_FLOOR)),
    Rule("`suspect_faults_by_worker` and `quarantined_workers` "
         "(`--skip_unit=worker --quarantine_after`; each decision in "
         "`quarantine_worker_<i>.json`, written before its line)",
         ("suspect_faults_by_worker", "quarantined_workers"),
         "kept (history); a recorded worker claims its place again",
         "kept (history)", (_WORKER_QUARANTINE,)),
    Rule("`consecutive_skips` (the streak)", ("consecutive_skips",),
         "kept", "reset to 0", (_THIRD,)),
    Rule("the rollbacks' own state: `rollbacks`, `rolled_back_steps`, "
         "`rollback_to_step`, `learning_rate_multiplier`",
         ("rollbacks", "rolled_back_steps", "rollback_to_step",
          "learning_rate_multiplier"),
         "kept", "kept, then counted (the rate halved with "
         "`--rollback_halve_learning_rate`)", (_ROLLED_BACK, _RERUN)),
    Rule("the input's position", (),
         "rebuilt: read from the start, the excluded examples (reproducible "
         "skips, rollback windows) dropped",
         "kept: the window's batches are not fed again; a quarantine's "
         "in-process rebuild continues past the batches already read; in a "
         "sync cluster every worker's",
         (_RESTART, _REBUILT_INPUT, _SYNC_WINDOW)),
    Rule("a stop signal (SIGTERM, Ctrl-C)", (),
         "ends the run: a final checkpoint, `exit_reason: interrupted`",
         "ends the run, also during a quarantine's rebuild",
         (_SIGNAL_REBUILD,)),
    Rule("`skips.jsonl`, `rollback_windows.jsonl`, `skips/` (files)", (),
         "kept", "kept (a rollback appends its window first)", (_RESTART,)),
    Rule("the last good checkpoint (the give-up line's)", (),
         "read from the checkpoints' history",
         "follows the history: never one of an abandoned window", (_GAVE_UP,)),
)


def _kept_names():
  return {name for rule in RULES
          if rule.rollback.startswith(("kept", "reset"))
          for name in rule.names}


def kept_on_rollback(graph=None):
  """The variables of `graph` a rollback leaves as they are (history, and
  the streak it resets itself): those `RULES` names, and every reason's
  counter (`criteria.COUNTERS_COLLECTION`)."""
  graph = graph or tf1.get_default_graph()
  names = _kept_names()
  kept = [v for v in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
          if v.op.name in names]
  if _REASON_COUNTERS in names:
    kept.extend(graph.get_collection(criteria.COUNTERS_COLLECTION))
  return kept


def unlisted(variables):
  """The names of `variables` (a step's counters) in no rule: a new
  counter must say whether it is history or model state."""
  listed = {name for rule in RULES for name in rule.names}
  return sorted(v.op.name for v in variables if v.op.name not in listed)


def table():
  """The docs' table of `RULES` (markdown lines)."""
  lines = ["| State | A restart | A rollback | Test |",
           "| --- | --- | --- | --- |"]
  for rule in RULES:
    lines.append("| %s | %s | %s | %s |" % (
        rule.state, rule.restart, rule.rollback,
        "; ".join("`tests/%s`" % t for t in rule.test)))
  return lines
