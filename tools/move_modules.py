#!/usr/bin/env python3
"""Moves the trainer's modules into subpackages by concept (issue #34).

Re-runnable: other branches edit these modules while the move is planned,
so the move is this script, not a commit to rebase. Run it from the
repository's root on a clean work tree (after merging), then commit:

  python3 tools/move_modules.py            # moves and rewrites
  python3 tools/move_modules.py --dry_run  # says what it would do

It (a) `git mv`s each module of MOVES (skipping those already moved) and
writes each subpackage's `__init__.py`; (b) rewrites every reference to an
old path in the package, tests/, bench/, examples/, tools/, docs/, .ci/,
README.md and the BUILD files: imports (`from tf1_safe_train.trainer import
X`, `import tf1_safe_train.trainer.X`), dotted strings (mock.patch,
`python -m`), doc paths (`trainer/X.py`), the trainer BUILD's srcs (its
labels stay: `//tf1_safe_train/trainer:X` names trainer/<sub>/X.py); (c)
moves a module's test from tests/trainer/X_test.py to
tests/trainer/<sub>/X_test.py (a flat tests/X_test.py stays); (d) prints
each change. A second run finds nothing to do.

No subpackage is named like a module it replaces (`towers` -> `tower/`):
`tf1_safe_train.trainer.towers` then never means two things, and a rewrite
never matches its own output.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys

PACKAGE = "tf1_safe_train"
TRAINER = "tf1_safe_train/trainer"

# Each subpackage: what lives there (its __init__.py's docstring), and its
# modules (old name -> new name; the same name unless renamed).
SUBPACKAGES = {
    "step": ("The step //:train builds: the towers' loss and gradients,\n"
             "the criteria, the guarded apply, its bookkeeping and summaries.",
             ["train_step", "tower_loss", "step_state",
              "step_summaries", "applied_update", "precision",
              "optimization"]),
    "drills": ("The --inject_nonfinite drills: the spec, parsed once, and\n"
               "the faults put into the graph.",
               ["drill", "injection", "injection_spec"]),
    "tower": ("The towers: devices and scopes, the tower unit (a step\n"
              "leaving towers out), its report line, quarantine.",
              ["towers", "tower_unit", "tower_report", "quarantine"]),
    "inputs": ("The towers' input by example id: stored batches, examples\n"
               "excluded at startup, a rollback's data window.",
               ["tower_input", "batch_store", "exclusion",
                "checkpoint_rollback_window"]),
    "run": ("The runner of //:train and //:eval: session, hooks, the\n"
            "replication interface, signals, train_dir, the run summary,\n"
            "a crash or a full disk told in one line.",
            ["train_lib", "eval_lib", "local_replication", "hooks",
             "segments", "run_summary", "run_story", "stop_signals",
             "train_dir", "crash_report", "disk_full"]),
    "checkpoint": ("Checkpoints: what a run resumes from, the last good one,\n"
                   "whether one fits the graph, the finite-state check.",
                   ["checkpoints", "last_good", "checkpoint_fit",
                    "finite_state"]),
    "recovery": ("--on_persistent_skips=rollback: an older checkpoint\n"
                 "restored in-process, its bookkeeping and target; what a\n"
                 "restart and a rollback keep (state_rules).",
                 ["checkpoint_rollback", "checkpoint_rollback_state",
                  "checkpoint_rollback_target", "state_rules"]),
    "explain": ("Explaining a skip (forensics): skips.jsonl records, the\n"
                "replay's verdict, saved states, verdict counts, offline\n"
                "replay.",
                ["forensics", "replay_lib", "verdict_counts", "skip_states",
                 "offline_replay"]),
    "config": ("The run's parameters: TrainParams and EvalParams, their\n"
               "validation, flag declarations and --help groups, recorded\n"
               "params, refusals before TensorFlow's import.",
               ["params", "param_validation", "flag_specs", "flag_groups",
                "recorded_params", "preflight", "one_machine_only"]),
}

# Renamed modules, old -> new (none yet): an import binding the old name
# keeps it as an alias (`from ....sub import new as old`), so no code that
# uses the module changes.
RENAMES = {}

# old module path (from the repository root) -> new path.
MOVES = {
    "%s/%s.py" % (TRAINER, old): "%s/%s/%s.py" % (
        TRAINER, sub, RENAMES.get(old, old))
    for sub, (_, names) in SUBPACKAGES.items() for old in names}

# A subpackage named like an old module would make the rewrite match its
# own output (and the old dotted name mean the package).
assert not set(SUBPACKAGES) & {
    old for _, names in SUBPACKAGES.values() for old in names}, SUBPACKAGES

# Where references are rewritten (files of these kinds, under these roots).
ROOTS = (PACKAGE, "tests", "bench", "examples", "tools", "docs", ".ci",
         "README.md", "BUILD", "pyproject.toml")
KINDS = (".py", ".md", ".bzl", ".toml", ".cfg", ".sh", ".txt", ".json")
NAMED = ("BUILD", "BUILD.bazel", "run", "WORKSPACE")


def _git(*args, check=True):
  return subprocess.run(["git"] + list(args), check=check,
                        capture_output=True, text=True).stdout


def _moves():
  """[(old name, subpackage, new name)] of every module."""
  return [(old, sub, RENAMES.get(old, old))
          for sub, (_, names) in SUBPACKAGES.items() for old in names]


def move_files(dry_run):
  """git mv each module not moved yet; writes the subpackages' inits."""
  done = []
  for sub, (doc, _) in SUBPACKAGES.items():
    init = os.path.join(TRAINER, sub, "__init__.py")
    if not os.path.exists(init):
      done.append("create %s" % init)
      if not dry_run:
        os.makedirs(os.path.dirname(init), exist_ok=True)
        with open(init, "w") as f:
          f.write('"""%s\n\n(docs/layout.md: the map.)\n"""\n' % doc)
        _git("add", init)
  for old, new in sorted(MOVES.items()):
    if os.path.exists(old) and not os.path.exists(new):
      done.append("git mv %s %s" % (old, new))
      if not dry_run:
        _git("mv", old, new)
    elif os.path.exists(old):
      done.append("BOTH EXIST, left alone: %s and %s" % (old, new))
  left = sorted(os.path.join(TRAINER, f) for f in os.listdir(TRAINER)
                if f.endswith(".py") and f != "__init__.py")
  for path in left:
    if not dry_run or path not in MOVES:
      done.append("NOT IN THE MAPPING (stays in trainer/): %s" % path)
  return done


def move_tests(dry_run):
  """tests/trainer/X_test.py -> tests/trainer/<sub>/X_test.py, if there."""
  done = []
  if not os.path.isdir("tests/trainer"):
    return done
  for old, sub, new in _moves():
    source = "tests/trainer/%s_test.py" % old
    target = "tests/trainer/%s/%s_test.py" % (sub, new)
    if os.path.exists(source) and not os.path.exists(target):
      done.append("git mv %s %s" % (source, target))
      if not dry_run:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # A tests folder that is a package makes its subfolders packages.
        if (os.path.exists("tests/trainer/__init__.py") and
            not os.path.exists(os.path.dirname(target) + "/__init__.py")):
          open(os.path.dirname(target) + "/__init__.py", "w").close()
          _git("add", os.path.dirname(target) + "/__init__.py")
        _git("mv", source, target)
  return done


def _rules():
  """[(compiled pattern, replacement)] for every moved module."""
  rules = []
  for old, sub, new in _moves():
    package = "tf1_safe_train.trainer.%s" % sub
    esc = re.escape(old)
    # `from tf1_safe_train.trainer import old [as alias]`.
    alias = "" if new == old else " as %s" % old
    rules.append((re.compile(
        r"from tf1_safe_train\.trainer import %s\b(?! as)" % esc),
                  "from %s import %s%s" % (package, new, alias)))
    rules.append((re.compile(
        r"from tf1_safe_train\.trainer import %s as\b" % esc),
                  "from %s import %s as" % (package, new)))
    # Dotted: `import tf1_safe_train.trainer.old`, mock.patch strings,
    # python -m, `from tf1_safe_train.trainer.old import X`.
    rules.append((re.compile(r"\btf1_safe_train\.trainer\.%s\b" % esc),
                  "%s.%s" % (package, new)))
    # Paths: docs, comments, tests reading files, tracebacks.
    rules.append((re.compile(r"(?<!\w)trainer/%s\.py" % esc),
                  "trainer/%s/%s.py" % (sub, new)))
    # A module's test in a folder mirroring the package.
    rules.append((re.compile(r"\btests/trainer/%s_test\.py" % esc),
                  "tests/trainer/%s/%s_test.py" % (sub, new)))
    if new != old:
      rules.append((re.compile(r"//tf1_safe_train/trainer:%s\b" % esc),
                    "//tf1_safe_train/trainer:%s" % new))
  return rules


def _trainer_build_rules():
  """The trainer BUILD's srcs (and names, if renamed) of moved modules."""
  rules = []
  for old, sub, new in _moves():
    rules.append((re.compile(r'"%s\.py"' % re.escape(old)),
                  '"%s/%s.py"' % (sub, new)))
    if new != old:
      rules.append((re.compile(r'(name = |":)%s"' % re.escape(old)),
                    r'\1%s"' % new))
  return rules


def _files():
  """Every text file under ROOTS that git tracks."""
  tracked = _git("ls-files", "--", *[r for r in ROOTS if os.path.exists(r)])
  for path in tracked.splitlines():
    name = os.path.basename(path)
    if (name.endswith(KINDS) or name in NAMED) and os.path.isfile(path):
      if path != "tools/move_modules.py":  # Its mapping names old paths.
        yield path


def _init_srcs(text):
  """The trainer library's srcs: its __init__.py and every subpackage's."""
  srcs = ["__init__.py"] + ["%s/__init__.py" % sub
                            for sub in sorted(SUBPACKAGES)]
  return re.sub(r'(name = "trainer",\s*srcs = )\[[^\]]*\]',
                lambda m: m.group(1) + "[\n        " + ",\n        ".join(
                    '"%s"' % s for s in srcs) + ",\n    ]", text, count=1)


def rewrite(dry_run):
  """Rewrites every reference to a moved module; returns what changed."""
  done = []
  rules = _rules()
  for path in _files():
    with open(path) as f:
      text = f.read()
    new = text
    for pattern, replacement in rules:
      new = pattern.sub(replacement, new)
    if path == "tests/trainer/BUILD":
      # Its tests that moved into a subfolder, named by path (a glob of
      # "*_test.py" there does not reach them: see the note printed last).
      for old, sub, renamed in _moves():
        if os.path.exists("tests/trainer/%s/%s_test.py" % (sub, renamed)):
          new = re.sub(r'"%s_test\.py"' % re.escape(old),
                       '"%s/%s_test.py"' % (sub, renamed), new)
    if path == TRAINER + "/BUILD":
      for pattern, replacement in _trainer_build_rules():
        new = pattern.sub(replacement, new)
      new = _init_srcs(new)
    if new != text:
      changed = sum(1 for line in difflib.ndiff(text.splitlines(),
                                                new.splitlines())
                    if line.startswith("+ "))
      done.append("rewrote %s (%d lines)" % (path, changed))
      if not dry_run:
        with open(path, "w") as f:
          f.write(new)
  return done


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dry_run", action="store_true",
                      help="say what would change, change nothing")
  args = parser.parse_args(argv)
  if not os.path.isdir(TRAINER):
    sys.exit("run this from the repository's root")
  done = move_files(args.dry_run)
  done += move_tests(args.dry_run)
  done += rewrite(args.dry_run)
  for line in done:
    print(line)
  print("%s: %d change(s)%s" % (os.path.basename(__file__), len(done),
                                " (dry run)" if args.dry_run else ""))
  print("Not rewritten automatically (check by hand): docs/layout.md's map "
        "(its indentation is the folders), module names built at run time "
        "from parts, tests/trainer/BUILD globs that do not reach the "
        "tests moved into its subfolders, a module added since the mapping "
        "(NOT IN THE MAPPING above: add it to SUBPACKAGES).")


if __name__ == "__main__":
  main(sys.argv[1:])
