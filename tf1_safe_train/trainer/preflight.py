"""The checks of a run's input that need no TensorFlow, made before its import.

Importing TensorFlow and building the graph take 5-10 s: a bad flag value,
drill spec or --train_dir is refused in a fraction of a second instead, with
the same line. `//:train` runs these checks before it imports TensorFlow
(every task of a cluster too, but for the train_dir); they run again where
they always ran (`train.py` and `train_lib.train`), so a library caller
loses nothing. Nothing this module
imports may import TensorFlow (tests/cli_test.py runs the refusals with an
unimportable TensorFlow).
"""

import os

from tf1_safe_train.trainer import injection_spec
from tf1_safe_train.trainer import train_dir as train_dir_lib

# The device nodes through which TensorFlow reaches a GPU: NVIDIA's driver
# (CUDA), WSL 2's paravirtualised GPU, AMD's ROCm driver. Without any of
# them no TensorFlow build sees a GPU.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


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
  then, on one machine, the train_dir (created if missing, as the run
  would; in a cluster the chief checks it once its server has started).

  Args:
    params: validated `params.TrainParams`.
    num_workers: the cluster's workers, or None on one machine.

  Raises:
    injection_spec.InjectionSpecError: for a bad --inject_nonfinite.
    train_dir.TrainDirError: for a --train_dir the run cannot use.
  """
  injection_spec.validate(injection_spec.parse_spec(params.inject_nonfinite),
                          params.num_towers, num_workers or 1)
  if num_workers is None:
    train_dir_lib.check(params.train_dir)
