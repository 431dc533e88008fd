"""The forensics' counts over skip records: a record's verdict key, and
the totals the chief's run summary merges from every worker's skips.jsonl.
"""

import collections

from tf1_safe_train.core import skip_log
from tf1_safe_train.trainer.explain import replay_lib

# The verdict of a finite skip (a spike, another criterion's): not replayed.
FINITE = "%s (finite; not replayed)"


def verdict_key(record):
  """A replayed record's verdict in the run summary's counts: reproducible
  (the data: its examples are excluded), model, undecided or
  not_reproducible (records written before the evidence rule: reproduced
  or not)."""
  if not record["reproduced"]:
    return "not_reproducible"
  if record.get("exclude", True):
    return "reproducible"
  return "model" if record.get("verdict") == replay_lib.MODEL else "undecided"


def totals(train_dir):
  """Counts over every worker's records in `train_dir` (all runs): the
  chief's run summary merges the workers' logs this way (in a cluster the
  chief's directory holds them all: `cluster.skip_relay`)."""
  verdicts, devices = collections.Counter(), collections.Counter()
  by_worker = collections.Counter()
  try:
    records = skip_log.read_all(train_dir)
  except skip_log.SkipLogError as e:  # Reported, not fatal: the run is over.
    return {"all_records_error": str(e)}
  for record in records:
    by_worker[str(record["worker"])] += 1
    if "reproduced" in record:
      verdicts[verdict_key(record)] += 1
    elif record.get("dry_run"):
      verdicts[record["reason"] + "_would_skip"] += 1
    elif record.get("verdict") == FINITE % record.get("reason"):
      verdicts[record["reason"]] += 1
    # A finite criterion's skip whose step also left out a non-finite
    # tower (--skip_unit=tower): its verdict above, the criterion here.
    for reason in record.get("reasons", [])[1:]:
      verdicts[reason] += 1
    if record.get("suspect_device"):
      devices[record["suspect_device"]] += 1
  return {"all_records": len(records), "all_verdicts": dict(verdicts),
          "all_records_by_worker": dict(sorted(by_worker.items())),
          "suspect_devices_all_runs": dict(devices)}
