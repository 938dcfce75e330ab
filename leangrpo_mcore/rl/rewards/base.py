"""The reward contract and its guard.

A reward is a callable ``(images (B, 3, H, W) float in [0, 1], prompts: list[str]) -> (B,) float32``.
``ValidatedReward`` wraps one so that a reward that raises, or returns a wrong shape or non-finite
values, stops training with a one-line ``RewardError`` naming it instead of a silent NaN. Its ``submit``
scores in the background (``reward.async_scoring``): through the reward's own ``submit(images, prompts) ->
Future`` where it has one (the remote reward), else on a worker thread.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

RewardFn = Callable[[Tensor, List[str]], Tensor]


class RewardError(RuntimeError):
    """A reward function failed or produced an unusable output."""


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def check_reward_inputs(images: Tensor, prompts: Sequence[str]) -> None:
    """ValueError unless ``images`` is a float (B, 3, H, W) tensor and ``prompts`` B strings."""
    if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be a (B, 3, H, W) tensor, got shape {tuple(getattr(images, 'shape', ()))}")
    if not images.dtype.is_floating_point:
        raise ValueError(f"images must be floating point in [0, 1], got {images.dtype}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        raise ValueError(f"prompts must be a list of {images.shape[0]} strings (one per image)")
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must all be strings")


def images_to_uint8(images: Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8 RGB numpy, rounding as DDPO/FlowGRPO do."""
    pixels = (images.detach().float() * 255.0).round().clamp(0, 255).to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def check_reward_output(name: str, values: object, batch_size: int) -> Tensor:
    """Return ``values`` as detached float32 (B,), or raise RewardError naming reward ``name``."""
    if not isinstance(values, Tensor):
        raise RewardError(f"reward '{name}' returned {type(values).__name__}, expected a torch.Tensor")
    if tuple(values.shape) != (batch_size,):
        raise RewardError(f"reward '{name}' returned shape {tuple(values.shape)}, expected ({batch_size},)")
    values = values.detach().to(torch.float32)
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise RewardError(f"reward '{name}' returned {bad} non-finite values")
    return values


class ValidatedReward:
    """A named reward whose inputs are checked and whose output is guaranteed finite float32 (B,)."""

    def __init__(self, name: str, fn: RewardFn) -> None:
        self.name = name
        self.fn = fn
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def _error(self, exc: BaseException) -> RewardError:
        if isinstance(exc, RewardError):
            return exc
        error = RewardError(f"reward '{self.name}' raised {type(exc).__name__}: {_one_line(exc)}")
        error.__cause__ = exc
        return error

    def __call__(self, images: Tensor, prompts: List[str]) -> Tensor:
        """Evaluate the reward; RewardError if it raises or returns a bad value."""
        check_reward_inputs(images, prompts)
        try:
            values = self.fn(images, list(prompts))
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001 -- any failure of user reward code becomes one clear error
            raise self._error(exc) from exc
        return check_reward_output(self.name, values, images.shape[0])

    def submit(self, images: Tensor, prompts: Sequence[str]) -> "Future[Tensor]":
        """Score in the background: a Future of what calling the reward returns, or of its RewardError.

        A reward with its own ``submit(images, prompts) -> Future`` gets the batch (the remote reward copies
        the images before it returns); any other reward is called on this object's worker thread, one batch
        at a time in submission order, so ``images`` must not change until the Future is done. Bad inputs
        raise ValueError here, as a call would.
        """
        check_reward_inputs(images, prompts)
        prompts = list(prompts)
        own = getattr(self.fn, "submit", None)
        if not callable(own):
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"reward-{self.name}")
                executor = self._executor
            return executor.submit(self, images, prompts)
        outer: Future = Future()
        batch = images.shape[0]
        try:
            inner = own(images, prompts)
        except Exception as exc:  # noqa: BLE001
            outer.set_exception(self._error(exc))
            return outer

        def settle(done: Future) -> None:
            try:
                outer.set_result(check_reward_output(self.name, done.result(), batch))
            except Exception as exc:  # noqa: BLE001
                outer.set_exception(self._error(exc))

        inner.add_done_callback(settle)
        return outer

    def close(self) -> None:
        """Stop the worker thread (after the batches already submitted)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"ValidatedReward({self.name!r})"
