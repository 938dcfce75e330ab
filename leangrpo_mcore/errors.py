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


# torch.load's weights-only unpickler wraps its one-word cause in a paragraph of advice about trusting the file.
_UNPICKLER_CAUSE = "WeightsUnpickler error:"


def exception_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``exc`` on one line (whitespace collapsed, at most ``limit`` characters of message);
    of torch's weights-only unpickler error only its cause ("Unsupported operand 103")."""
    text = str(exc)
    if _UNPICKLER_CAUSE in text:
        cause = text.split(_UNPICKLER_CAUSE, 1)[1].split("Check the documentation", 1)[0]
        text = f"{_UNPICKLER_CAUSE} {cause}"
    return f"{type(exc).__name__}: {' '.join(text.split())[:limit]}"


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
