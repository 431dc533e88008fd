"""The checks of a run's input that need no TensorFlow, made before its import.

Importing TensorFlow and building the graph take 5-10 s: a bad flag value,
drill spec, --train_dir or CIFAR-10 file is refused in a fraction of a
second instead, with the same line. `//:train` runs these checks before it
imports TensorFlow (every task of a cluster too, but for the train_dir and
the data); they run again where they always ran (`train.py` and
`train_lib.train`), so a library caller loses nothing. Nothing this module
imports may import TensorFlow (tests/e2e/cli_test.py and
tests/e2e/reliability_bad_input_test.py run the refusals with an unimportable
TensorFlow).
"""

import os

from tf1_safe_train.trainer.drills import injection_spec
from tf1_safe_train.trainer.config import one_machine_only
from tf1_safe_train.trainer.config import params as params_lib
from tf1_safe_train.trainer.run import train_dir as train_dir_lib

# The device nodes through which TensorFlow reaches a GPU: NVIDIA's driver
# (CUDA), WSL 2's paravirtualised GPU, AMD's ROCm driver. Without any of
# them no TensorFlow build sees a GPU.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")

# `cifar10.SPLIT_FILES["train"]` and `cifar10.RECORD_BYTES`, which cannot be
# imported without TensorFlow (tests/e2e/reliability_bad_input_test.py checks
# that both checks refuse the same files with the same line).
_CIFAR10_TRAIN_FILES = tuple("data_batch_%d.bin" % i for i in range(1, 6))
_CIFAR10_RECORD_BYTES = 3073


class DataError(ValueError):
  """A local CIFAR-10 directory or file that `cifar10.check_files` refuses."""


def visible_gpus(device):
  """The GPU count `train.make_params` needs, if known without TensorFlow.

  Args:
    device: the --device flag.

  Returns:
    0 for --device=cpu (the count does not matter then) or on a machine with
    no GPU device node; None when only TensorFlow can tell.
  """
  if device == "cpu":
    return 0
  if any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
    return None
  return 0


def check(params, num_workers=None):
  """Refuses what the task would refuse after TensorFlow's import.

  In the trainer's order: the drill spec against the towers and workers,
  then, in a cluster, the options that run on one machine only, or, on one
  machine, the train_dir (created if missing, as the run
  would, and not in use by another trainer; in a cluster the chief checks
  it once its server has started),
  then the CIFAR-10 training files (in a cluster each worker checks them
  after the import: a ps reads none).

  Args:
    params: validated `params.TrainParams`.
    num_workers: the cluster's workers, or None on one machine.

  Raises:
    injection_spec.InjectionSpecError: for a bad --inject_nonfinite.
    train_dir.TrainDirError: for a --train_dir the run cannot use.
    DataError: for CIFAR-10 training files the run would refuse.
    params.ParamsError: in a cluster, for an option of one machine only.
  """
  injection_spec.validate(injection_spec.parse_spec(params.inject_nonfinite),
                          params.num_towers, num_workers or 1,
                          params.inject_into)
  if num_workers is not None:
    refusal = one_machine_only.refusal(params)
    if refusal:
      raise params_lib.ParamsError(refusal)
  else:
    train_dir_lib.check(params.train_dir)
    train_dir_lib.check_free(params.train_dir)
    if params.dataset == "cifar10":
      check_cifar10_train_files(params.data_dir)


def cpu_cores():
  """The CPU cores this process may run on (its affinity, where known)."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


def towers_warning(params, cores=None):
  """One line when CPU towers outnumber the cores, else None.

  Towers on virtual CPU devices share the machine's cores: beyond one per
  core they add no throughput, and each step runs them in turns
  (--num_towers=64 on 2 cores: 68 s for 2 steps, without a word). Allowed
  (e.g. to rehearse an 8-GPU run's tower count), but said. GPU towers
  beyond the GPUs are refused (`train.make_params`).

  Args:
    params: validated `params.TrainParams` (device resolved).
    cores: the cores to compare with; default `cpu_cores()`.
  """
  cores = cpu_cores() if cores is None else cores
  if params.device != "cpu" or params.num_towers <= cores:
    return None
  return ("--num_towers=%d on --device=cpu, but this process may use %d CPU "
          "core(s): the towers take turns on them, so every step does %d "
          "towers' work at the speed of %d (use --num_towers=%d or fewer "
          "unless you mean to rehearse that many towers)" % (
              params.num_towers, cores, params.num_towers, cores, cores))


def check_cifar10_train_files(data_dir):
  """`cifar10.check_files(data_dir, "train")` for a local `data_dir`.

  A remote one (gs://...) is left to that check, which reads it through
  TensorFlow's file systems.

  Raises:
    DataError: with `cifar10.check_files`'s message.
  """
  if not data_dir or "://" in data_dir:
    return
  if not os.path.isdir(data_dir):
    raise DataError("cifar10: data_dir %s does not exist or is not a "
                    "directory" % data_dir)
  for filename in _CIFAR10_TRAIN_FILES:
    path = os.path.join(data_dir, filename)
    if not os.path.exists(path):
      raise DataError("cifar10: %s does not exist (expected the binary "
                      "version of CIFAR-10)" % path)
    size = os.path.getsize(path)
    if size == 0:
      raise DataError("cifar10: %s is empty" % path)
    if size % _CIFAR10_RECORD_BYTES:
      raise DataError("cifar10: %s is %d bytes, not a multiple of the "
                      "%d-byte record" % (path, size, _CIFAR10_RECORD_BYTES))
