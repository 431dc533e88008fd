"""The package as pip installs it: a wheel built offline, used elsewhere.

The wheel is built from a copy of the sources (`pip wheel` writes build/ and
*.egg-info next to them), installed without dependencies into a fresh
virtualenv that sees the project's TensorFlow through a `.pth` file, and
used from outside the repository: the README's wrapper example, the
binaries as `python -m tf1_safe_train.NAME` and as console scripts
(`tf1-safe-train`, whose --help names it); and into one without
TensorFlow, which says what to install (the trainer in one line). The
extras pin the TensorFlow tested, and the README's Keras command is the one
./bazelw runs.
"""

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import tensorflow as tf

_BINARIES = ("train", "eval", "replay", "local_cluster")
# pyproject.toml's [project.scripts]: each runs its binary.
_SCRIPTS = {"train": "tf1-safe-train", "eval": "tf1-safe-train-eval",
            "replay": "tf1-safe-train-replay",
            "local_cluster": "tf1-safe-train-local-cluster"}


def _root():
  """Where this test's inputs are: the runfiles under Bazel, else the repo."""
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    return os.path.join(srcdir, os.environ["TEST_WORKSPACE"])
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                      os.pardir)


def _source_root():
  """The repository itself (runfiles link into it)."""
  return os.path.dirname(
      os.path.realpath(os.path.join(_root(), "pyproject.toml")))


def _modules(root):
  """The package's .py files under `root`, relative to it."""
  return sorted(
      os.path.relpath(path, root) for path in glob.glob(
          os.path.join(root, "tf1_safe_train", "**", "*.py"), recursive=True))


def _copy_sources(destination):
  """Copies what `pip wheel` needs (no build outputs, no BUILD files)."""
  root = _root()
  for name in ["pyproject.toml", "README.md"] + _modules(root):
    os.makedirs(os.path.join(destination, os.path.dirname(name)),
                exist_ok=True)
    shutil.copyfile(os.path.join(root, name), os.path.join(destination, name))


def _env():
  """This environment, offline for pip, without this test's sys.path."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PIP_NO_INDEX="1",
             PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
  for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"):
    env.pop(name, None)
  return env


def _run(args, cwd, timeout=300):
  result = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)
  if result.returncode != 0:
    raise AssertionError("%s exited %d:\n%s\n%s" % (
        " ".join(args), result.returncode, result.stdout, result.stderr))
  return result


def _readme_example():
  """The python block after the readme-example marker (tests/readme_test)."""
  with open(os.path.join(_root(), "README.md")) as f:
    match = re.search(r"<!-- readme-example[^>]*-->\s*```python\n(.*?)```",
                      f.read(), re.S)
  return match.group(1)


class PipInstallTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    work = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"),
                        "pip_install_test_%d" % os.getpid())
    shutil.rmtree(work, ignore_errors=True)
    cls.work = work
    cls.sources = os.path.join(work, "src")
    _copy_sources(cls.sources)
    dist = os.path.join(work, "dist")
    _run([sys.executable, "-m", "pip", "wheel", cls.sources, "--no-deps",
          "--no-build-isolation", "-w", dist], cwd=work)
    cls.wheel, = glob.glob(os.path.join(dist, "*.whl"))
    # A fresh virtualenv whose only view of the project's packages
    # (TensorFlow, absl, numpy) is a .pth file: it is installed without
    # dependencies, as a user's virtualenv that has TensorFlow already.
    venv = os.path.join(work, "venv")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
    cls.python = os.path.join(venv, "bin", "python")
    site = _run([cls.python, "-c",
                 "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=work).stdout.strip()
    with open(os.path.join(site, "project_packages.pth"), "w") as f:
      f.write(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", cls.python, "install",
          "--no-deps", cls.wheel], cwd=work)
    cls.site = site
    # And one without TensorFlow.
    bare = os.path.join(work, "bare")
    _run([sys.executable, "-m", "venv", "--without-pip", bare], cwd=work)
    cls.bare_python = os.path.join(bare, "bin", "python")
    _run([sys.executable, "-m", "pip", "--python", cls.bare_python,
          "install", "--no-deps", cls.wheel], cwd=work)
    # With absl-py and numpy, which `pip install` brings (the package's
    # requirements), for the binaries.
    bare_site = _run([cls.bare_python, "-c", "import sysconfig; "
                      "print(sysconfig.get_paths()['purelib'])"],
                     cwd=work).stdout.strip()
    for name in ("absl", "numpy", "numpy.libs"):
      path = os.path.join(sysconfig.get_paths()["purelib"], name)
      if os.path.exists(path):
        os.symlink(path, os.path.join(bare_site, name))
    cls.bare = bare
    cls.venv = venv
    cls.outside = os.path.join(work, "elsewhere")
    os.makedirs(cls.outside)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.work, ignore_errors=True)
    super().tearDownClass()

  def testSourcesHoldTheWholePackage(self):
    # Under Bazel the sources are the runfiles of //:pip_sources: a module
    # that no target there reaches would be missing from the wheel.
    self.assertEqual(_modules(self.sources), _modules(_source_root()))
    self.assertIn(os.path.join("tf1_safe_train", "core", "optimizer.py"),
                  _modules(self.sources))

  def testWheelHoldsEveryModule(self):
    # pyproject.toml's packages: a folder (the trainer's step/, run/, ...)
    # that its list missed would install without its modules.
    with zipfile.ZipFile(self.wheel) as wheel:
      packed = sorted(n for n in wheel.namelist() if n.endswith(".py"))
    self.assertEqual(packed, [m.replace(os.sep, "/")
                              for m in _modules(self.sources)])
    self.assertIn("tf1_safe_train/trainer/step/train_step.py", packed)

  def testWheelRequiresNoTensorFlow(self):
    # A requirement on `tensorflow` would pull a second TensorFlow over
    # tensorflow-cpu or tensorflow[and-cuda]; only the extras name one.
    with zipfile.ZipFile(self.wheel) as wheel:
      metadata, = [n for n in wheel.namelist() if n.endswith("/METADATA")]
      requires = re.findall(r"(?m)^Requires-Dist: (.*)$",
                            wheel.read(metadata).decode())
    self.assertIn("absl-py", requires)
    for requirement in requires:
      if requirement.startswith("tensorflow"):
        self.assertIn("extra ==", requirement)

  def testReadmeExampleRunsFromTheInstalledPackage(self):
    code = ("import tf1_safe_train\nprint('from', tf1_safe_train.__file__)\n" +
            _readme_example())
    result = _run([self.python, "-c", code], cwd=self.outside)
    self.assertIn("from " + os.path.join(self.site, "tf1_safe_train"),
                  result.stdout)
    self.assertIn("global_step 5 applied 4 skipped 1 finite True",
                  result.stdout)

  def testWithoutTensorFlowSaysWhatToInstall(self):
    result = subprocess.run(
        [self.bare_python, "-c",
         "import tf1_safe_train; tf1_safe_train.SkipNonFiniteOptimizer"],
        cwd=self.outside, env=_env(), capture_output=True, text=True,
        timeout=60, check=False)
    self.assertNotEqual(0, result.returncode)
    self.assertIn(
        "ImportError: tf1_safe_train needs TensorFlow (2.21 is the version "
        "tested), which this Python does not have: pip install "
        "tensorflow-cpu==2.21.*", result.stderr)

  def testConsoleScriptsRunTheBinariesAndTheirHelpNamesThem(self):
    with zipfile.ZipFile(self.wheel) as wheel:
      entry_points, = [n for n in wheel.namelist()
                       if n.endswith("/entry_points.txt")]
      text = wheel.read(entry_points).decode()
    scripts = dict(re.findall(r"(?m)^(tf1-safe-train\S*) = (\S+)$", text))
    self.assertEqual(sorted(scripts), sorted(_SCRIPTS.values()))
    for binary, script in _SCRIPTS.items():
      with self.subTest(script=script):
        result = _run([os.path.join(self.venv, "bin", script), "--help"],
                      cwd=self.outside)
        # The docstring's `./bazelw run //:NAME -- --flag...` example.
        self.assertIn("\n  %s --" % script, result.stdout)
        self.assertNotIn("bazelw", result.stdout)
        # Its own flags, under its installed file's name (absl's
        # "<file>:" or //:train's grouped "flags of <file>, by concept:").
        self.assertIn(
            os.path.join(self.site, "tf1_safe_train", binary + ".py"),
            result.stdout)
    result = _run([os.path.join(self.venv, "bin", "tf1-safe-train"),
                   "--help"], cwd=self.outside)
    self.assertIn("--max_steps", result.stdout)

  def testTrainerWithoutTensorFlowSaysWhatToInstallInOneLine(self):
    result = subprocess.run(
        [os.path.join(self.bare, "bin", "tf1-safe-train"),
         "--train_dir=" + os.path.join(self.work, "run")],
        cwd=self.outside, env=_env(), capture_output=True, text=True,
        timeout=60, check=False)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(result.stderr.splitlines(), [
        "train: error: tf1_safe_train needs TensorFlow (2.21 is the version "
        "tested), which this Python does not have: pip install "
        "tensorflow-cpu==2.21.* or 'tensorflow[and-cuda]==2.21.*' (or the "
        "extra tf1_safe_train[cpu] or [gpu])"])

  def testExtrasPinTheTestedTensorFlow(self):
    with zipfile.ZipFile(self.wheel) as wheel:
      metadata, = [n for n in wheel.namelist() if n.endswith("/METADATA")]
      requires = re.findall(r"(?m)^Requires-Dist: (.*)$",
                            wheel.read(metadata).decode())
    with open(os.path.join(_source_root(), "requirements.txt")) as f:
      tested = re.search(r"(?m)^tensorflow-cpu==(\d+\.\d+)\.\d+$",
                         f.read()).group(1)
    pinned = [r for r in requires if r.startswith(("tensorflow", "tensorboard"))]
    self.assertLen(pinned, 3)
    for requirement in pinned:
      self.assertRegex(requirement, r"==%s\.\*; extra == " % re.escape(tested))

  def testKerasCommandInstallsNoSecondTensorFlow(self):
    # tf-keras requires the full `tensorflow` wheel, which pip would install
    # over tensorflow-cpu: the README's command is the one ./bazelw runs
    # (--no-deps, requirements-legacy.txt's pin).
    requires = importlib.metadata.requires("tf-keras")
    self.assertTrue(any(re.match(r"tensorflow\b(?!-)", r) for r in requires),
                    requires)
    root = _source_root()
    with open(os.path.join(root, "requirements-legacy.txt")) as f:
      pin, = re.findall(r"(?m)^tf-keras==\S+$", f.read())
    with open(os.path.join(root, "bazelw")) as f:
      self.assertRegex(f.read(), r"--no-deps \\\n\s+-r \"\$\{root\}/"
                       r"requirements-legacy.txt\"")
    with open(os.path.join(root, "README.md")) as f:
      self.assertIn("pip install --no-deps " + pin, " ".join(f.read().split()))

  def testBinariesRunAsModules(self):
    for binary in _BINARIES:
      with self.subTest(binary=binary):
        result = _run([self.python, "-m", "tf1_safe_train." + binary,
                       "--help"], cwd=self.outside)
        self.assertIn(
            os.path.join(self.site, "tf1_safe_train", binary + ".py"),
            result.stdout)
    result = _run([self.python, "-m", "tf1_safe_train.train", "--help"],
                  cwd=self.outside)
    self.assertIn("--max_steps", result.stdout)


if __name__ == "__main__":
  tf.test.main()
