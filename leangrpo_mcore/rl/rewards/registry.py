"""Registry of reward functions.

A new reward is one decorated function or class::

    @register_reward("brightness")
    def brightness(images, prompts, *, scale=1.0):
        return scale * images.mean(dim=(1, 2, 3))

A registered *function* is the reward itself; ``build_reward`` binds its keyword options. A registered
*class* is a factory: ``build_reward`` instantiates it with the options (for rewards holding a model).
Rewards outside the package are named ``package.module:callable`` or installed as entry points (see
:mod:`leangrpo_mcore.rl.rewards.plugins`) and follow the same contract.
"""

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional

from leangrpo_mcore.errors import UserError

from .base import PLUGIN_FAILURES, ValidatedReward, parse_frames, show_traceback
from .plugins import entry_point_names, load_plugin

REWARDS: Dict[str, Callable[..., Any]] = {}


def register_reward(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a reward function (or a reward class, instantiated by ``build_reward``) as ``name``."""

    def decorator(obj: Callable[..., Any]) -> Callable[..., Any]:
        if name in REWARDS:
            raise ValueError(f"reward '{name}' is already registered")
        REWARDS[name] = obj
        return obj

    return decorator


def available_rewards() -> List[str]:
    """Names of the registered rewards, sorted."""
    return sorted(REWARDS)


def _signature(obj: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # some C callables have no introspectable signature
        return None


def _check_call(name: str, fn: Any, options: Dict[str, Any]) -> None:
    """UserError unless ``fn(images, prompts, **options)`` binds (with ``metadata=`` and ``reference_images=``
    where ``fn`` declares them: a reward may take each prompt's metadata dict and each sample's conditioning image,
    see :class:`~leangrpo_mcore.rl.rewards.base.ValidatedReward`)."""
    signature = _signature(fn)
    if signature is None:
        return
    try:
        signature.bind_partial(None, None)
    except TypeError:
        raise UserError(f"reward '{name}' must be callable as (images, prompts); its signature is "
                        f"{signature}") from None
    extra = {key: None for key in ("metadata", "reference_images")
             if key in signature.parameters and key not in options}
    try:
        signature.bind(None, None, **options, **extra)
    except TypeError as exc:
        raise UserError(f"reward '{name}': bad options {sorted(options)}: {exc}") from None


def _resolve(name: str) -> Callable[..., Any]:
    obj = REWARDS.get(name)
    if obj is None:
        obj = load_plugin(name)
    if obj is None:
        installed = entry_point_names()
        extra = f"; installed plugins: {', '.join(installed)}" if installed else ""
        raise UserError(f"unknown reward '{name}'; valid: {', '.join(available_rewards())}{extra}, "
                        "or package.module:callable")
    return obj


def build_reward(name: str, **options: Any) -> ValidatedReward:
    """Build reward ``name`` with its keyword ``options``, wrapped in a ``ValidatedReward``.

    ``name`` is a registered reward, a ``package.module:callable`` spec or an installed entry point
    (:mod:`~leangrpo_mcore.rl.rewards.plugins`). A function takes ``options`` as keyword arguments, a class as
    constructor arguments; options the callable does not take, a signature that cannot take
    ``(images, prompts)``, or an import that fails is a one-line :class:`~leangrpo_mcore.errors.UserError`.
    Option ``frames`` ("first", "mean" or N; default "first") belongs to every reward and is not passed on: it
    picks the frames of a video that the ``ValidatedReward`` scores (see :mod:`.base`).
    """
    frames = parse_frames(options.pop("frames", "first"))
    obj = _resolve(name)
    builtin = name in REWARDS
    if not inspect.isclass(obj):
        _check_call(name, obj, options)
        return ValidatedReward(name, functools.partial(obj, **options) if options else obj, frames)
    signature = _signature(obj)
    if signature is not None:
        try:
            signature.bind(**options)
        except TypeError as exc:
            raise UserError(f"reward '{name}': bad options {sorted(options)}: {exc}") from None
    try:
        fn = obj(**options)
    except PLUGIN_FAILURES as exc:  # a failing plugin constructor is one line
        if (builtin and not isinstance(exc, SystemExit)) or isinstance(exc, UserError):
            raise
        show_traceback(exc)
        raise UserError(f"reward '{name}': {obj.__name__}(...) raised {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())}") from None
    if not callable(fn):
        raise UserError(f"reward '{name}': instances of {obj.__name__} are not callable (define __call__)")
    _check_call(name, fn, {})
    return ValidatedReward(name, fn, frames)
