"""What a skip says is built in one module, `core/skip_report.py`.

Read statically over every module of the package (issue #34, "one
report"): the skip line's format, the skips.jsonl record's fields and a
criterion's words and record fields each appear in skip_report.py alone,
so changing what a skip says is one edit; and every reason's counter is
named by `criteria.counter_name`, none by hand.
"""

import ast
import os
import subprocess
import sys

import tensorflow as tf

import tf1_safe_train
from tf1_safe_train.core import criteria
from tf1_safe_train.core import skip_report

_SKIP_REPORT = "core/skip_report.py"
# The keys that make a dict a skips.jsonl record's head.
_RECORD_HEAD = {"step", "worker", "reason"}


def _modules():
  """(path relative to the package, parsed tree) of every module."""
  top = os.path.dirname(tf1_safe_train.__file__)
  for folder, _, files in os.walk(top):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path) as f:
          yield os.path.relpath(path, top), ast.parse(f.read())


def _where(matches):
  """The sorted paths of the modules with a node `matches(node)`."""
  return sorted(path for path, tree in _modules()
                if any(matches(node) for node in ast.walk(tree)))


def _string(node):
  return (node.value if isinstance(node, ast.Constant) and
          isinstance(node.value, str) else None)


def _skip_line_format(node):
  """A format string of the skip line ("skipped step %d...")."""
  return "skipped step %" in (_string(node) or "")


def _record_head(node):
  """A dict display or dict(...) call with a record's head keys."""
  if isinstance(node, ast.Dict):
    keys = {_string(k) for k in node.keys if k is not None}
  elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
        node.func.id == "dict"):
    keys = {k.arg for k in node.keywords}
  else:
    return False
  return _RECORD_HEAD <= keys


def _criterion_words(node):
  """`<report>.criterion(reason).describe(...)` or `.record(...)`: a
  criterion's words in a line, its fields in a record."""
  return (isinstance(node, ast.Call) and
          isinstance(node.func, ast.Attribute) and
          node.func.attr in ("describe", "record") and
          isinstance(node.func.value, ast.Call) and
          isinstance(node.func.value.func, ast.Attribute) and
          node.func.value.func.attr == "criterion")


def _counter_named_by_hand(node):
  """`reason + "_skips"` (or "_would_skips"): a counter's name built."""
  return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and
          any(_string(side) in ("_skips", "_would_skips")
              for side in (node.left, node.right)))


class OneModuleSaysWhatASkipSaysTest(tf.test.TestCase):

  def testTheChecksFindWhatTheyLookFor(self):
    def found(check, source):
      return any(check(n) for n in ast.walk(ast.parse(source)))
    self.assertTrue(found(_skip_line_format, 'x = "skipped step %d: %s"'))
    self.assertFalse(found(_skip_line_format, 'x = "a skipped step"'))
    self.assertTrue(found(_record_head, 'x = {"step": 1, "worker": 0, '
                                        '"time": 2, "reason": "r"}'))
    self.assertTrue(found(_record_head,
                          "x = dict(step=1, worker=0, reason='r')"))
    self.assertFalse(found(_record_head, 'x = {"step": 1, "worker": 0}'))
    self.assertTrue(found(_criterion_words,
                          "r.criterion(reason).record(v['values'])"))
    self.assertTrue(found(_criterion_words, "self.criterion(r).describe(v)"))
    self.assertTrue(found(_counter_named_by_hand, 'n = r + "_skips"'))
    self.assertTrue(found(_counter_named_by_hand, 'n = r + "_would_skips"'))
    self.assertFalse(found(_counter_named_by_hand, 'n.endswith("_skips")'))

  def testTheSkipLinesFormatIsInOneModule(self):
    self.assertEqual(_where(_skip_line_format), [_SKIP_REPORT])

  def testTheSkipsJsonlRecordIsAssembledInOneModule(self):
    self.assertEqual(_where(_record_head), [_SKIP_REPORT])

  def testACriterionsWordsAndFieldsAreTakenInOneModule(self):
    self.assertEqual(_where(_criterion_words), [_SKIP_REPORT])

  def testNoReasonCounterIsNamedByHand(self):
    self.assertEqual(_where(_counter_named_by_hand), [])


class NoTensorFlowTest(tf.test.TestCase):

  def testTheRecordsModuleImportsNoTensorFlow(self):
    # //:train's early checks (train_dir, before TensorFlow's import) write
    # the rollback window's record through skip_report: a TensorFlow
    # import there puts its start-up chatter on the first screen.
    script = ("import sys\n"
              "from tf1_safe_train.core import skip_report\n"
              "from tf1_safe_train.trainer.inputs import "
              "checkpoint_rollback_window\n"
              "print('tensorflow' in sys.modules)")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), "False")


class CounterNamesTest(tf.test.TestCase):

  def testACounterIsNamedAfterItsReasonAndReadBack(self):
    self.assertEqual(criteria.counter_name("spike"), "spike_skips")
    self.assertEqual(criteria.counter_name("spike", True),
                     "spike_would_skips")
    for reason in ("nonfinite", "spike", "grad_norm", "my_skips"):
      for dry_run in (False, True):
        self.assertEqual(criteria.counter_reason(
            criteria.counter_name(reason, dry_run)), (reason, dry_run))
    with self.assertRaisesRegex(ValueError, "no reason's counter"):
      criteria.counter_reason("applied_steps")

  def testTheRunSummarysCountsByReason(self):
    self.assertEqual(skip_report.summary_fields(
        {"nonfinite_skips": 2, "grad_norm_skips": 1,
         "spike_would_skips": 3}),
                     {"skips_by_reason": {"nonfinite": 2, "grad_norm": 1},
                      "would_skips_by_reason": {"spike": 3},
                      "nonfinite_skips": 2, "spike_skips": 0})
    self.assertEqual(skip_report.progress_words(
        {"nonfinite_skips": 2, "spike_skips": 1, "spike_would_skips": 2}),
                     " (1 spike; 2 would-be spikes)")


if __name__ == "__main__":
  tf.test.main()
