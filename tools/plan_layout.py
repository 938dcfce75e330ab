"""Plan a cluster run: the same as the ``leangrpo-plan`` command (see ``leangrpo_mcore/cli/plan.py``)."""

import sys

from leangrpo_mcore.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
