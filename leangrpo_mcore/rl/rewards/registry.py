"""Registry of reward functions.

A new reward is one decorated function or class::

    @register_reward("brightness")
    def brightness(images, prompts, *, scale=1.0):
        return scale * images.mean(dim=(1, 2, 3))

A registered *function* is the reward itself; ``build_reward`` binds its keyword options. A registered
*class* is a factory: ``build_reward`` instantiates it with the options (for rewards holding a model).
"""

import functools
import inspect
from typing import Any, Callable, Dict, List

from .base import RewardFn, ValidatedReward

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


def build_reward(name: str, **options: Any) -> ValidatedReward:
    """Build reward ``name`` with its keyword ``options``, wrapped in a ``ValidatedReward``."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward '{name}'; valid: {', '.join(available_rewards())}")
    obj = REWARDS[name]
    signature = inspect.signature(obj)
    try:
        if inspect.isclass(obj):
            signature.bind(**options)
        else:
            signature.bind(None, None, **options)
    except TypeError as exc:
        raise ValueError(f"reward '{name}': bad options {sorted(options)}: {exc}") from None
    fn: RewardFn
    if inspect.isclass(obj):
        fn = obj(**options)
    else:
        fn = functools.partial(obj, **options) if options else obj
    return ValidatedReward(name, fn)
