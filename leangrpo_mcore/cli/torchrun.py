"""`leangrpo-torchrun`: torchrun whose job ends with the ranks' one ``error:`` line, not with a launcher traceback.

``leangrpo-torchrun [torchrun options] -m leangrpo_mcore.train --config FILE [overrides]`` (or ``python -m
leangrpo_mcore.launch ...``) takes exactly torchrun's arguments and runs ``torch.distributed.run``. Plain
torchrun turns any failed rank into ``ChildFailedError``: its agent logs the failure, and its ``main`` prints
its own traceback and a failure summary, then exits with 1, even when the ranks stopped on bad input that one
rank has already reported in one line. Here a job whose first failed rank stopped that way (its torchrun error
file holds a message and no Python call stack, and its exit code is 2 for bad input or 124 for a stall) ends
with that rank's exit code and nothing more; any other failure prints torchrun's summary (each failed rank's
traceback) without the launcher's own, and exits with 1. A signal the launcher itself receives (SIGTERM,
SIGUSR1 forwarded to the ranks for a preemption save) ends it with 128 + the signal number.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from leangrpo_mcore import __version__

ONE_LINE_EXIT_CODES = (2, 124)
"""Exit codes of ranks that reported their failure in one ``error:`` line (bad input; a stall)."""
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def reported_in_one_line(failure: ProcessFailure) -> bool:
    """Whether ``failure`` is a rank that stopped with its one ``error:`` line (see the module doc)."""
    message = failure.error_file_data.get("message")
    if failure.exitcode not in ONE_LINE_EXIT_CODES or not isinstance(message, dict):
        return False
    return bool(message.get("message")) and "py_callstack" not in message.get("extraInfo", {})


def exit_code_of(error: ChildFailedError) -> Optional[int]:
    """The job's exit code when its first failure was reported in one line, else None (print the summary)."""
    _, first = error.get_first_failure()
    return first.exitcode if reported_in_one_line(first) else None


class _QuietOneLineFailures(logging.Filter):
    """Drop the agent's "failed (exitcode: 2) local_rank: ..." record: the rank has said why in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the agent's failure record of a one-line exit code."""
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("failed (exitcode") and args and args[0] in ONE_LINE_EXIT_CODES)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); returns the exit code (see the module doc)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:  # torchrun's own parser has no --version; every tool of the package answers it
        print(f"leangrpo_mcore {__version__}")
        raise SystemExit(0)
    args = torchrun.parse_args(argv)
    quiet = _QuietOneLineFailures()
    logging.getLogger(_AGENT_LOGGER).addFilter(quiet)
    try:
        torchrun.run(args)
    except ChildFailedError as error:
        code = exit_code_of(error)
        if code is not None:
            return code
        print(error.format_msg(), file=sys.stderr, flush=True)
        return 1
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    finally:
        logging.getLogger(_AGENT_LOGGER).removeFilter(quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
