"""Rewards that live outside the package: ``package.module:callable`` specs and installed entry points.

``reward.name: my_rewards.aesthetic:Scorer`` imports ``my_rewards.aesthetic`` (from ``PYTHONPATH`` or an
installed package) and takes its attribute ``Scorer`` (dots after the colon walk nested attributes). A name
without a colon that no built-in reward has is looked up in the entry-point group ``leangrpo_mcore.rewards``,
which an installed package declares in its packaging metadata::

    [project.entry-points."leangrpo_mcore.rewards"]
    aesthetic = "my_rewards.aesthetic:Scorer"

The object follows the registry's contract: a function ``(images, prompts, **options) -> (B,)`` rewards, or a
class instantiated with ``**options`` whose instances are such callables. Every failure to find or load it is
one :class:`~leangrpo_mcore.errors.UserError` line.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Callable, List

from leangrpo_mcore.errors import UserError

from .base import PLUGIN_FAILURES, show_traceback

ENTRY_POINT_GROUP = "leangrpo_mcore.rewards"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_import_spec(name: str) -> bool:
    """Whether ``name`` has the ``package.module:attribute`` form."""
    return ":" in name


def _load_spec(spec: str) -> Any:
    module_name, _, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not module_name or not attr_path:
        raise UserError(f"reward '{spec}': a plugin reward is named package.module:callable")
    try:
        module = importlib.import_module(module_name)
    except PLUGIN_FAILURES as exc:  # any failure while importing user code is one line
        show_traceback(exc)
        raise UserError(f"reward '{spec}': cannot import module '{module_name}': {_one_line(exc)}") from None
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UserError(f"reward '{spec}': module '{module_name}' has no attribute '{attr_path}'")
        obj = getattr(obj, part)
    return obj


def entry_point_names() -> List[str]:
    """Names of the rewards that installed packages declare in the ``leangrpo_mcore.rewards`` group, sorted."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def _load_entry_point(name: str) -> Any:
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        return None
    values = sorted({ep.value for ep in found})
    if len(values) > 1:
        raise UserError(f"reward '{name}': several installed packages declare it ({', '.join(values)})")
    try:
        return found[0].load()
    except PLUGIN_FAILURES as exc:  # a broken installed plugin is one line
        show_traceback(exc)
        raise UserError(f"reward '{name}': cannot load entry point {values[0]}: {_one_line(exc)}") from None


def load_plugin(name: str) -> Callable[..., Any] | None:
    """The callable named by ``name`` (an import spec or an entry-point name), or None when no entry point has
    that name; UserError when it cannot be imported or is not callable."""
    obj = _load_spec(name) if is_import_spec(name) else _load_entry_point(name)
    if obj is None:
        return None
    if not callable(obj):
        raise UserError(f"reward '{name}': {type(obj).__name__} object is not callable "
                        "(a reward is a function or a class)")
    return obj
