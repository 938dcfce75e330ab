"""Field helper for the config dataclasses: defaults plus the checks the loader enforces.

Every field of a section is declared with :func:`option`, which records its allowed range or choices in the
dataclass field's metadata. The field's documentation is the string literal placed right after it (an
"attribute docstring", as megatron-core's ``TransformerConfig`` does); :func:`field_docs` reads them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any


def option(
    default: Any = dataclasses.MISSING,
    *,
    factory: Any = dataclasses.MISSING,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field whose value the loader checks against ``choices`` and the bounds."""
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def range_error(value: Any, meta: dict) -> str | None:
    """Why ``value`` violates the field's ``choices`` / bounds, or None when it is fine."""
    if value is None:
        return None
    choices = meta.get("choices")
    if choices is not None:
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if v not in choices]
        if bad:
            return f"{bad[0]!r} is not one of {', '.join(repr(c) for c in choices)}"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    checks = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"))
    for key, ok, symbol in checks:
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            return f"{value!r} must be {symbol} {bound}"
    return None


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass: ``{field name: text}``."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = inspect.cleandoc(node.value.value)
    return docs
