"""Video sample grids: an H.264 mp4 whose every frame is the sample grid of that frame (the ``video`` extra).

Each frame is laid out as the PNG grid of :mod:`leangrpo_mcore.engine.output.samples` (one :class:`GridLayout`, so the
captions sit in the same place throughout the clip). ffmpeg comes from the imageio-ffmpeg wheel; H.264 in
yuv420p needs an even width and height, so the grid is padded with white on the right and bottom. The file is
written to a temporary ``.mp4`` (ffmpeg picks the container from the name) and renamed, so a killed run never
leaves a truncated video.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from types import ModuleType
from typing import Sequence

import numpy as np
import torch

from leangrpo_mcore.engine.output.samples import GridLayout, video_to_uint8
from leangrpo_mcore.errors import UserError, require_extra

CODEC = "libx264"
CRF = 25
"""H.264 constant rate factor: imageio's default quality 5 of 10 (51 x (1 - 5/10), rounded down)."""


def require_video_extra() -> ModuleType:
    """``imageio_ffmpeg`` (which ships ffmpeg), after checking that imageio is there too; a one-line UserError
    naming the ``video`` extra otherwise."""
    require_extra("imageio.v3", "video", "writing video samples")
    return require_extra("imageio_ffmpeg", "video", "writing video samples")


def ffmpeg_command(ffmpeg: str, path: str, height: int, width: int, fps: int) -> list[str]:
    """ffmpeg reading raw RGB frames of ``height`` x ``width`` from stdin and writing an H.264 (yuv420p) mp4 to
    ``path``: imageio's writer command with its default quality (CRF 25), errors only on stderr."""
    return [ffmpeg, "-y", "-v", "error", "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}",
            "-pix_fmt", "rgb24", "-r", str(int(fps)), "-i", "-", "-an", "-vcodec", CODEC, "-pix_fmt", "yuv420p",
            "-crf", str(CRF), path]


def ffmpeg_failure(returncode: int, stderr: bytes) -> str:
    """Why ffmpeg failed: the OS error its exit code carries (ffmpeg exits with AVERROR(errno) & 255, e.g. 228
    for ENOSPC, "No space left on device"), else the last line of its stderr, else the exit code."""
    code = 256 - returncode if 0 < returncode < 256 else 0
    if code in errno.errorcode:
        return os.strerror(code)
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1].strip() if lines else f"ffmpeg exited with code {returncode}"


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
    imageio_ffmpeg = require_video_extra()
    if fps < 1:
        raise ValueError(f"video fps must be >= 1, got {fps}")
    frames = video_grid_frames(videos, prompts, rewards, columns=columns)
    tmp = f"{path}.tmp-{os.getpid()}.mp4"
    command = ffmpeg_command(imageio_ffmpeg.get_ffmpeg_exe(), tmp, frames.shape[1], frames.shape[2], fps)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # ffmpeg's own stderr and exit code say why a write failed (a full disk is "No space left on device";
        # the writer only sees the pipe close); communicate() feeds the frames and reads stderr without a deadlock.
        done = subprocess.run(command, input=np.ascontiguousarray(frames).tobytes(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, check=False)
        if done.returncode != 0:
            raise UserError(f"cannot write {path}: {ffmpeg_failure(done.returncode, done.stderr)}")
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return frames


def save_video_grid(path: str, videos: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float], *,
                    fps: int = 8, columns: int = 4) -> np.ndarray:
    """Write the grid of ``videos`` (B, 3, F, H, W) float in [0, 1] to ``path`` (H.264 mp4) atomically, each
    sample captioned with its prompt and reward; returns the written frames (F, H', W', 3) uint8."""
    return write_video_grid(path, video_to_uint8(videos), prompts, rewards, fps=fps, columns=columns)
