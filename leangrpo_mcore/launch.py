"""``python -m leangrpo_mcore.launch [torchrun options] -m leangrpo_mcore.train --config FILE [overrides]``.

The same command as ``leangrpo-torchrun``: torchrun whose failed job ends with the ranks' one ``error:`` line;
see :mod:`leangrpo_mcore.cli.torchrun`.
"""

import sys

from leangrpo_mcore.cli.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
