"""The project's user-facing error type.

A :class:`UserError` is bad input (a config key, a path, a checkpoint, a reward's output) whose message is one
complete line that names the cause; the command-line entry points print it and exit with code 2, no traceback.
"""


class UserError(ValueError):
    """Bad input, reported as one line by the CLI (exit code 2)."""
