"""``torchrun --nproc-per-node N -m leangrpo_mcore.eval --config FILE [--checkpoint DIR] [--out FILE] [...]``.

The same command as ``leangrpo-eval``; see :mod:`leangrpo_mcore.cli.eval`.
"""

import sys

from leangrpo_mcore.cli.eval import launch

if __name__ == "__main__":
    sys.exit(launch())
