"""Video sample grids: an H.264 mp4 whose every frame is the sample grid of that frame (the ``video`` extra).

Each frame is laid out as the PNG grid of :mod:`leangrpo_mcore.engine.output.samples` (one :class:`GridLayout`, so the
captions sit in the same place throughout the clip). ffmpeg comes from the imageio-ffmpeg wheel; H.264 in
yuv420p needs an even width and height, so the grid is padded with white on the right and bottom. The file is
written to a temporary ``.mp4`` (ffmpeg picks the container from the name) and renamed, so a killed run never
leaves a truncated video.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Sequence

import numpy as np
import torch

from leangrpo_mcore.engine.output.samples import GridLayout, video_to_uint8
from leangrpo_mcore.errors import UserError, require_extra

CODEC = "libx264"


def require_video_extra() -> ModuleType:
    """``imageio.v3``, after checking that imageio-ffmpeg (which ships ffmpeg) is there too; a one-line
    UserError naming the ``video`` extra otherwise."""
    imageio = require_extra("imageio.v3", "video", "writing video samples")
    require_extra("imageio_ffmpeg", "video", "writing video samples")
    return imageio


def video_grid_frames(videos: np.ndarray, prompts: Sequence[str], rewards: Sequence[float], *,
                      columns: int = 4) -> np.ndarray:
    """(F, H', W', 3) uint8: frame k is the captioned grid of frame k of every ``videos`` (B, F, H, W, 3) uint8,
    padded to an even size."""
    if videos.ndim != 5 or videos.shape[-1] != 3 or videos.dtype != np.uint8:
        raise ValueError(f"videos must be (B, F, H, W, 3) uint8, got {videos.dtype} {tuple(videos.shape)}")
    count, frames, height, width = videos.shape[:4]
    layout = GridLayout.build(count, height, width, prompts, rewards, columns=columns)
    grid = np.stack([np.asarray(layout.render(videos[:, k])) for k in range(frames)])
    pad_h, pad_w = grid.shape[1] % 2, grid.shape[2] % 2
    if pad_h or pad_w:
        grid = np.pad(grid, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), constant_values=255)
    return grid


def write_video_grid(path: str, videos: np.ndarray, prompts: Sequence[str], rewards: Sequence[float], *,
                     fps: int = 8, columns: int = 4) -> np.ndarray:
    """Write the grid of ``videos`` (B, F, H, W, 3) uint8 to ``path`` (H.264 mp4) atomically; returns its frames.

    A missing imageio or imageio-ffmpeg is a one-line UserError naming the ``video`` extra; a failed write is
    one naming ``path`` and leaves no temporary file.
    """
    imageio = require_video_extra()
    if fps < 1:
        raise ValueError(f"video fps must be >= 1, got {fps}")
    frames = video_grid_frames(videos, prompts, rewards, columns=columns)
    tmp = f"{path}.tmp-{os.getpid()}.mp4"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # macro_block_size=1: the frames are already even-sized; imageio would otherwise rescale them to 16k.
        imageio.imwrite(tmp, frames, plugin="FFMPEG", fps=fps, codec=CODEC, macro_block_size=1)
        os.replace(tmp, path)
    except OSError as err:  # ffmpeg's broken pipe on a full disk is one too
        raise UserError(f"cannot write {path}: {_reason(err)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return frames


def _reason(err: OSError) -> str:
    """The OS's reason, or the first line of imageio-ffmpeg's message (which appends ffmpeg's command line)."""
    if err.strerror:
        return err.strerror
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def save_video_grid(path: str, videos: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float], *,
                    fps: int = 8, columns: int = 4) -> np.ndarray:
    """Write the grid of ``videos`` (B, 3, F, H, W) float in [0, 1] to ``path`` (H.264 mp4) atomically, each
    sample captioned with its prompt and reward; returns the written frames (F, H', W', 3) uint8."""
    return write_video_grid(path, video_to_uint8(videos), prompts, rewards, fps=fps, columns=columns)
