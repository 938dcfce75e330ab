"""``torchrun --nproc-per-node N -m leangrpo_mcore.train --config FILE [dotted.key=value ...]``.

The same command as ``leangrpo-train``; see :mod:`leangrpo_mcore.cli.train`.
"""

import sys

from leangrpo_mcore.cli.train import launch

if __name__ == "__main__":
    sys.exit(launch())
