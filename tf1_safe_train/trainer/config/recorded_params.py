"""What a finished run recorded of itself, for the binaries that read it.

`//:eval` evaluates a run's checkpoint: the graph it builds must be the
model the run trained, which `run_summary.json` records (its "params", as
`//:replay` reads a skip's saved params). A flag not given takes the run's
value; one given that contradicts the checkpoint's graph (--model) is
refused in one line; one that only changes what is evaluated (--dataset,
--data_dir) wins. This module imports no TensorFlow: it runs before the
import.
"""

import json
import os

from tf1_safe_train.trainer.config import params as params_lib

RUN_SUMMARY = "run_summary.json"  # run_summary.RUN_SUMMARY, without TF.

# Fields that shape the graph a checkpoint restores into: a flag naming
# another value than the run's cannot evaluate the run's checkpoint.
_GRAPH_FIELDS = ("model",)
# Fields that say what is evaluated: the run's value unless a flag is given.
_DATA_FIELDS = ("dataset", "data_dir")
# The flags that, all given, leave nothing to read.
EVAL_FIELDS = frozenset(_GRAPH_FIELDS + _DATA_FIELDS)


def read(train_dir):
  """The "params" `<train_dir>/run_summary.json` records, or None.

  None when there is no such file (a first run still going, or a directory
  of another trainer): the flags then say everything, as before.

  Raises:
    params.ParamsError: the file exists but holds no params object (given
      --model, --dataset and --data_dir, //:eval does not read it).
  """
  path = os.path.join(train_dir, RUN_SUMMARY)
  try:
    with open(path) as f:
      summary = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise params_lib.ParamsError("%s: not readable as JSON (%s)" % (
        path, getattr(e, "strerror", None) or e)) from None
  recorded = summary.get("params") if isinstance(summary, dict) else None
  if not isinstance(recorded, dict):
    raise params_lib.ParamsError("%s: no \"params\" object (damaged, or of "
                                 "another trainer)" % path)
  return recorded


def for_eval(values, given, recorded, train_dir):
  """`values` (the eval flags) completed from the run's `recorded` params.

  Args:
    values: {EvalParams field: its flag's value}.
    given: the names of the flags given on the command line.
    recorded: `read(train_dir)`, or None.
    train_dir: the run's directory (for the error line).

  Returns:
    A new dict: each graph or data field not `given` takes the run's value.

  Raises:
    params.ParamsError: a given flag contradicts the run's graph.
  """
  values = dict(values)
  if recorded is None:
    return values
  for name in _GRAPH_FIELDS + _DATA_FIELDS:
    if name not in recorded:
      continue
    if name not in given:
      values[name] = recorded[name]
    elif name in _GRAPH_FIELDS and values[name] != recorded[name]:
      raise params_lib.ParamsError(
          "--%s=%s, but the run in %s trained --%s=%s (%s): its checkpoint "
          "holds that graph; drop --%s" % (
              name, values[name], train_dir, name, recorded[name],
              RUN_SUMMARY, name))
  return values
