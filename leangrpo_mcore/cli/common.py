"""What every entry point shares: one-line errors with exit code 2, ``--version``, and rank-aware output.

Under torchrun a bad input is printed once, by the first rank that fails
(:func:`~leangrpo_mcore.engine.launch.first_to_report`); every failing rank also writes the line to torchrun's
error file (``TORCHELASTIC_ERROR_FILE``), which torchrun shows in its failure summary instead of "To enable
traceback see ...". The ranks exit with code 2; torchrun itself then exits with 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from leangrpo_mcore import __version__
from leangrpo_mcore.errors import UserError, write_error_file  # noqa: F401 -- write_error_file: part of this API

EXIT_USER_ERROR = 2


def add_version_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` a ``--version`` flag printing ``leangrpo_mcore <version>``; returns the parser."""
    parser.add_argument("--version", action="version", version=f"leangrpo_mcore {__version__}")
    return parser


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``; a :class:`UserError` (or a missing file) becomes one line on stderr and exit 2.

    Set ``LEANGRPO_TRACEBACK=1`` to see the traceback of such an error.
    """
    try:
        code = main(argv)
    except (UserError, FileNotFoundError) as err:
        if os.environ.get("LEANGRPO_TRACEBACK") == "1":
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if _reports_errors():
            print(f"error: {message}", file=sys.stderr, flush=True)
        write_error_file(message)
        return getattr(err, "exit_code", EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(code or 0)



def _reports_errors() -> bool:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    from leangrpo_mcore.engine.launch import first_to_report

    return first_to_report()
