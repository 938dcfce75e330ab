"""The project's user-facing error type.

A :class:`UserError` is bad input (a config key, a path, a checkpoint, a reward's output) whose message is one
complete line that names the cause; the command-line entry points print it and exit with code 2, no traceback.
A missing optional dependency is one too (:func:`require_extra`): its line names the extra that installs it.
"""

import importlib
from types import ModuleType


class UserError(ValueError):
    """Bad input, reported as one line by the CLI (exit code 2)."""


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
