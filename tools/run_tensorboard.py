"""`//:tensorboard`: TensorBoard, from the project's virtualenv.

  ./bazelw run //:tensorboard -- --logdir=/tmp/quickstart

serves the run's scalars (`loss`, `skips/*`, `loss_scale` in fp16) and each
explained skip as text (`skips/explained`) on http://localhost:6006/. (Not
named tensorboard.py: as a script's own folder comes first on sys.path, that
name would hide the tensorboard package.)
"""

import os

from tensorboard import main as tensorboard_main


def main():
  # `bazel run` starts a binary in its runfiles: a relative --logdir means
  # the folder the command was typed in.
  working_directory = os.environ.get("BUILD_WORKING_DIRECTORY")
  if working_directory:
    os.chdir(working_directory)
  tensorboard_main.run_main()


if __name__ == "__main__":
  main()
