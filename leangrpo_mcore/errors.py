"""The project's user-facing error type.

A :class:`UserError` is bad input (a config key, a path, a checkpoint, a reward's output) whose message is one
complete line that names the cause; the command-line entry points print it and exit with code 2, no traceback.
A missing optional dependency is one too (:func:`require_extra`): its line names the extra that installs it.
"""

import importlib
import json
import os
import time
from types import ModuleType


class UserError(ValueError):
    """Bad input, reported as one line by the CLI (exit code 2)."""


class CollectiveTimeoutError(UserError):
    """A collective waited ``parallel.timeout_minutes`` for a rank that never joined it: one line like bad input,
    with the exit code of a stall (124, the step watchdog's and ``timeout``'s)."""

    exit_code = 124


class MissingExtraError(UserError):
    """An optional dependency is not installed; the message names the package extra that provides it."""


def require_extra(module: str, extra: str, feature: str) -> ModuleType:
    """``import module``, or :class:`MissingExtraError` saying that ``feature`` needs ``pip install
    'leangrpo_mcore[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        detail = f" ({exc.name} is missing)" if exc.name and exc.name != module.split(".")[0] else ""
        raise MissingExtraError(f"{feature} needs the '{extra}' extra{detail}: "
                                f"pip install 'leangrpo_mcore[{extra}]'") from None


def write_error_file(message: str) -> None:
    """Under torchrun, put ``message`` in this rank's error file (the format of torchrun's own error handler,
    without a traceback: torchrun prints the message as the failure's "traceback")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as fp:
            json.dump(record, fp)
    except OSError:
        pass  # the summary then says "To enable traceback see ..."; the error line is on stderr anyway
