"""Module fixtures computed once per test process.

Under pytest-xdist (`-n 2`, the README's test command) a worker tears its module-scoped fixtures down whenever the
queue of tests it was handed runs dry, and sets them up again for the module's next test: a fixture that spawns
ranks and trains would run two or three times. :func:`once_per_process` keeps the first value for the process.
Only for fixtures that return (a yield fixture's teardown would run before the value is used again)."""

from __future__ import annotations

import functools
from typing import Any, Callable


def once_per_process(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` evaluated on its first call only; later calls return that value (its arguments are the fixture's
    own, the same every time)."""
    done: dict[str, Any] = {}

    @functools.wraps(body)
    def first_value(*args: Any, **kwargs: Any) -> Any:
        if "value" not in done:
            done["value"] = body(*args, **kwargs)
        return done["value"]

    return first_value
