"""The reward contract and its guard.

A reward is a callable ``(images (B, 3, H, W) float in [0, 1], prompts: list[str]) -> (B,) float32``. It may
declare the keywords ``metadata`` (each prompt's dataset fields) and ``reference_images`` (each sample's
conditioning image, (B, 3, H, W) float in [0, 1] at the run's resolution, in runs with ``data.images``).
``ValidatedReward`` wraps one so that a reward that raises, or returns a wrong shape or non-finite
values, stops training with a one-line ``RewardError`` naming it instead of a silent NaN (a reward calling
``sys.exit`` included; ``LEANGRPO_TRACEBACK=1`` prints the reward's own traceback on the rank where it failed,
as the error line that reaches every rank carries no traceback). Its ``submit``
scores in the background (``reward.async_scoring``): through the reward's own ``submit(images, prompts) ->
Future`` where it has one (the remote reward), else on a worker thread.
"""

import inspect
import os
import sys
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from leangrpo_mcore.errors import UserError

RewardFn = Callable[[Tensor, List[str]], Tensor]


class RewardError(RuntimeError):
    """A reward function failed or produced an unusable output."""


PLUGIN_FAILURES = (Exception, SystemExit)
"""What a reward's own code may raise and the guard turns into one line (``sys.exit`` in a plugin included:
it would otherwise end its rank alone, and the others would see only a closed connection)."""


def show_traceback(exc: BaseException) -> None:
    """Print ``exc``'s traceback to stderr when ``LEANGRPO_TRACEBACK=1`` (the one-line error hides it)."""
    if os.environ.get("LEANGRPO_TRACEBACK") == "1":
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


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


Frames = Union[str, int]


def parse_frames(frames: object) -> Frames:
    """``reward.options.frames`` checked: "first", "mean" or an int >= 1 (a string of digits counts)."""
    if isinstance(frames, str) and frames.strip().isdigit():
        frames = int(frames.strip())
    if frames in ("first", "mean") or (isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1):
        return frames
    raise UserError(f"reward.options.frames must be first, mean or an integer >= 1, got {frames!r}")


def frame_indices(frames: Frames, num_frames: int) -> List[int]:
    """The indices of the frames scored out of ``num_frames`` (see the module doc)."""
    if frames == "first":
        return [0]
    if frames == "mean":
        return list(range(num_frames))
    return torch.linspace(0, num_frames - 1, int(frames), dtype=torch.float64).round().long().tolist()


def flatten_videos(images: Tensor, prompts: Sequence[str], frames: Frames) -> Tuple[Tensor, List[str], int]:
    """(B·k, 3, H, W) frames, B·k prompts (each repeated k times) and k of videos (B, 3, F, H, W); images (B, 3,
    H, W) pass unchanged with k = 1. ValueError for other shapes or a prompt count that does not match."""
    if isinstance(images, Tensor) and images.ndim == 5 and images.shape[1] == 3:
        if isinstance(prompts, str) or len(prompts) != images.shape[0]:
            raise ValueError(f"prompts must be a list of {images.shape[0]} strings (one per video)")
        if images.shape[2] < 1:
            raise ValueError("videos must have at least one frame")
        index = torch.tensor(frame_indices(frames, images.shape[2]), device=images.device)
        picked = images.index_select(2, index).transpose(1, 2)  # (B, k, 3, H, W)
        k = picked.shape[1]
        return picked.reshape(-1, *picked.shape[2:]), [p for p in prompts for _ in range(k)], k
    if isinstance(images, Tensor) and images.ndim == 5:
        raise ValueError(f"videos must be a (B, 3, F, H, W) tensor, got shape {tuple(images.shape)}")
    return images, prompts, 1


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


def takes_keyword(fn: object, name: str) -> bool:
    """Whether the reward function (or a callable object's ``__call__``) declares a parameter ``name``."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some C callables have no introspectable signature
        return False


def takes_metadata(fn: object) -> bool:
    """Whether the reward function (or a callable object's ``__call__``) declares a ``metadata`` parameter."""
    return takes_keyword(fn, "metadata")


def check_reference_images(references: object, batch: int) -> Tensor:
    """``references`` as a float (batch, 3, H, W) tensor; ValueError otherwise."""
    if not isinstance(references, Tensor) or references.ndim != 4 or references.shape[:2] != (batch, 3):
        raise ValueError(f"reference_images must be a ({batch}, 3, H, W) tensor, got shape "
                         f"{tuple(getattr(references, 'shape', ()))}")
    if not references.dtype.is_floating_point:
        raise ValueError(f"reference_images must be floating point in [0, 1], got {references.dtype}")
    return references


class ValidatedReward:
    """A named reward whose inputs are checked and whose output is guaranteed finite float32 (B,).

    It takes images (B, 3, H, W) or videos (B, 3, F, H, W), the videos scored on ``frames`` (module doc).
    """

    def __init__(self, name: str, fn: RewardFn, frames: Frames = "first") -> None:
        self.name = name
        self.fn = fn
        self.frames = parse_frames(frames)
        self.takes_metadata = takes_metadata(fn)
        """Whether ``fn`` declares a ``metadata`` keyword: it then gets each prompt's metadata dict too."""
        self.takes_reference_images = takes_keyword(fn, "reference_images")
        """Whether ``fn`` declares a ``reference_images`` keyword: it then gets each sample's conditioning image."""
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def _error(self, exc: BaseException) -> RewardError:
        if isinstance(exc, RewardError):
            return exc
        show_traceback(exc)
        error = RewardError(f"reward '{self.name}' raised {type(exc).__name__}: {_one_line(exc)}")
        error.__cause__ = exc
        return error

    def _flatten(self, images: Tensor, prompts: Sequence[str]) -> Tuple[Tensor, List[str], int]:
        """The checked image batch the reward function scores, its prompts, and the frames per video k."""
        flat, flat_prompts, k = flatten_videos(images, prompts, self.frames)
        check_reward_inputs(flat, flat_prompts)
        return flat, list(flat_prompts), k

    def _finish(self, values: object, batch: int, k: int) -> Tensor:
        """The checked (B·k,) values averaged over each video's k frames: float32 (B,)."""
        values = check_reward_output(self.name, values, batch * k)
        return values if k == 1 else values.view(batch, k).to(torch.float64).mean(dim=1).to(torch.float32)

    @property
    def needs_reference_images(self) -> bool:
        """Whether the reward compares with the conditioning image (a weighted reward: whether a component does)."""
        return self.takes_reference_images and bool(getattr(self.fn, "needs_reference_images", True))

    def _extra(self, metadata: Optional[Sequence[dict]], batch: int, k: int,
               references: Optional[Tensor] = None) -> dict:
        """The ``metadata=`` and ``reference_images=`` keywords the function declares (a video's entries repeated
        for its k frames)."""
        extra: dict = {}
        if self.takes_metadata:
            rows = list(metadata) if metadata is not None else [{} for _ in range(batch)]
            if len(rows) != batch:
                raise ValueError(f"metadata must hold one dict per sample ({batch}), got {len(rows)}")
            extra["metadata"] = [row for row in rows for _ in range(k)]
        if self.takes_reference_images:
            if references is not None:
                references = check_reference_images(references, batch)
                references = references.repeat_interleave(k, dim=0) if k > 1 else references
            extra["reference_images"] = references
        return extra

    def __call__(self, images: Tensor, prompts: List[str], metadata: Optional[Sequence[dict]] = None,
                 reference_images: Optional[Tensor] = None) -> Tensor:
        """Evaluate the reward; RewardError if it raises or returns a bad value. ``metadata`` (one dict per sample:
        the other fields of a prompt's metadata line) reaches a function that declares a ``metadata`` keyword,
        ``reference_images`` (B, 3, H, W) one that declares ``reference_images``."""
        flat, flat_prompts, k = self._flatten(images, prompts)
        extra = self._extra(metadata, flat.shape[0] // k, k, reference_images)
        try:
            values = self.fn(flat, flat_prompts, **extra)
        except RewardError:
            raise
        except PLUGIN_FAILURES as exc:  # any failure of user reward code becomes one clear error
            raise self._error(exc) from exc
        return self._finish(values, flat.shape[0] // k, k)

    def submit(self, images: Tensor, prompts: Sequence[str], metadata: Optional[Sequence[dict]] = None,
               reference_images: Optional[Tensor] = None) -> "Future[Tensor]":
        """Score in the background: a Future of what calling the reward returns, or of its RewardError.

        A reward with its own ``submit(images, prompts) -> Future`` gets the batch (the remote reward copies
        the images before it returns); any other reward is called on this object's worker thread, one batch
        at a time in submission order, so ``images`` must not change until the Future is done. Bad inputs
        raise ValueError here, as a call would.
        """
        flat, flat_prompts, k = self._flatten(images, prompts)
        own = getattr(self.fn, "submit", None)
        if not callable(own):
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"reward-{self.name}")
                executor = self._executor
            return executor.submit(self, images, list(prompts), metadata, reference_images)
        outer: Future = Future()
        batch = flat.shape[0] // k
        try:
            inner = own(flat, flat_prompts, **self._extra(metadata, batch, k, reference_images))
        except PLUGIN_FAILURES as exc:
            outer.set_exception(self._error(exc))
            return outer

        def settle(done: Future) -> None:
            try:
                outer.set_result(self._finish(done.result(), batch, k))
            except PLUGIN_FAILURES as exc:
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
