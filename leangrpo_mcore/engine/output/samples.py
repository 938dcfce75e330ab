"""Sample grids: generated images side by side, each captioned with its prompt and reward (PIL).

Video samples are shown by their first frame here; :mod:`leangrpo_mcore.engine.output.video` writes the whole clip,
one :class:`GridLayout` frame per video frame. Images are float tensors in [0, 1]; the grid is written through a
temporary file and a rename, so a killed run never leaves a truncated PNG. In an image-conditioned run each tile is
[source | result] (:func:`beside_sources`): the conditioning image, a white gap, the sample; in a video grid the
source stands beside every frame of the clip.
"""

from __future__ import annotations

import contextlib
import math
import os
import textwrap
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from leangrpo_mcore.errors import UserError

CAPTION_LINES = 3
_LINE_HEIGHT = 12
_GAP = 4
SOURCE_GAP = 2
"""White pixels between a conditioning image and its sample in a [source | result] tile."""


def first_frames(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) images, or the first frame of (B, 3, F, H, W) videos."""
    if images.ndim == 5:
        return images[:, :, 0]
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"samples must be (B, 3, H, W) images or (B, 3, F, H, W) videos, got {tuple(images.shape)}")
    return images


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8; NaN becomes 0."""
    pixels = torch.nan_to_num(images.detach().float(), nan=0.0).clamp(0.0, 1.0)
    return (pixels * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def video_to_uint8(videos: torch.Tensor) -> np.ndarray:
    """(B, 3, F, H, W) float in [0, 1] -> (B, F, H, W, 3) uint8; NaN becomes 0."""
    if videos.ndim != 5 or videos.shape[1] != 3:
        raise ValueError(f"videos must be (B, 3, F, H, W), got {tuple(videos.shape)}")
    pixels = torch.nan_to_num(videos.detach().float(), nan=0.0).clamp(0.0, 1.0)
    return (pixels * 255.0).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu().numpy()


def beside_sources(samples: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """[source | result] tiles: images (B, H, W, 3) or videos (B, F, H, W, 3) uint8, each with its conditioning
    image (B, h, w, 3) uint8 on the left (scaled to H x W with nearest neighbours where its size differs) and
    :data:`SOURCE_GAP` white columns between them; a video's source stands beside every frame."""
    video = samples.ndim == 5
    height, width = samples.shape[-3:-1]
    if sources.ndim != 4 or sources.shape[0] != samples.shape[0] or samples.ndim not in (4, 5):
        raise ValueError(f"beside_sources: samples {samples.shape} and sources {sources.shape} do not pair up")
    if sources.shape[1:3] != (height, width):
        sources = np.stack([np.asarray(Image.fromarray(src).resize((width, height), Image.NEAREST))
                            for src in sources])
    if video:
        sources = np.broadcast_to(sources[:, None], (*samples.shape[:2], *sources.shape[1:]))
    gap = np.full((*samples.shape[:-2], SOURCE_GAP, 3), 255, dtype=np.uint8)
    return np.concatenate([sources, gap, samples], axis=-2)


def _caption(prompt: str, reward: float, width_chars: int) -> list[str]:
    lines = textwrap.wrap(prompt, width=max(width_chars, 8)) or [""]
    lines = lines[: CAPTION_LINES - 1]
    lines.append(f"reward {reward:.4g}")
    return lines


@dataclass(frozen=True)
class GridLayout:
    """Where each sample of a grid goes: a white canvas with every caption drawn, and the tiles' corners.

    The captions are drawn once; :meth:`render` pastes one frame per sample onto a copy, so that the PNG grid
    and every frame of the video grid share one layout.
    """

    background: Image.Image
    """The canvas with the captions and empty tiles."""
    origins: tuple[tuple[int, int], ...]
    """(x, y) of each sample's tile, in sample order."""
    cell: tuple[int, int]
    """(width, height) of a tile in pixels (the sample upscaled by a whole factor)."""

    @classmethod
    def build(cls, count: int, height: int, width: int, prompts: Sequence[str], rewards: Sequence[float], *,
              columns: int = 4) -> GridLayout:
        """The layout of ``count`` samples of ``height`` x ``width`` pixels, ``columns`` per row."""
        if len(prompts) != count or len(rewards) != count:
            raise ValueError(f"sample grid: {count} images but {len(prompts)} prompts and {len(rewards)} rewards")
        if count == 0:
            raise ValueError("a sample grid needs at least one image")
        # Tiny CPU samples are upscaled so that the caption is readable next to them.
        scale = max(1, math.ceil(128 / max(width, 1)))
        cell_w, cell_h = width * scale, height * scale
        cols = max(1, min(columns, count))
        rows = math.ceil(count / cols)
        caption_h = CAPTION_LINES * _LINE_HEIGHT + _GAP
        canvas = Image.new("RGB", (cols * (cell_w + _GAP), rows * (cell_h + caption_h + _GAP)), "white")
        draw = ImageDraw.Draw(canvas)
        font = ImageFont.load_default()
        origins = []
        for i in range(count):
            x = (i % cols) * (cell_w + _GAP) + _GAP // 2
            y = (i // cols) * (cell_h + caption_h + _GAP) + _GAP // 2
            origins.append((x, y))
            for k, line in enumerate(_caption(str(prompts[i]), float(rewards[i]), cell_w // 6)):
                draw.text((x, y + cell_h + 2 + k * _LINE_HEIGHT), line, fill="black", font=font)
        return cls(canvas, tuple(origins), (cell_w, cell_h))

    def render(self, frames: np.ndarray) -> Image.Image:
        """The grid of one frame per sample: ``frames`` (B, H, W, 3) uint8."""
        if frames.shape[0] != len(self.origins):
            raise ValueError(f"sample grid: layout of {len(self.origins)} samples, got {frames.shape[0]} frames")
        canvas = self.background.copy()
        for frame, origin in zip(frames, self.origins):
            canvas.paste(Image.fromarray(frame).resize(self.cell, Image.NEAREST), origin)
        return canvas


def make_grid(images: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float], *,
              columns: int = 4) -> Image.Image:
    """A PIL image: a grid of the samples, each with its prompt (wrapped) and reward written under it."""
    frames = to_uint8(first_frames(images))
    layout = GridLayout.build(frames.shape[0], frames.shape[1], frames.shape[2], prompts, rewards, columns=columns)
    return layout.render(frames)


def save_grid(path: str, images: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float], *,
              columns: int = 4) -> Image.Image:
    """Write :func:`make_grid` to ``path`` (PNG) atomically; returns the image. A failed write (a full disk, a
    missing permission) is a UserError naming ``path`` and leaves no temporary file."""
    grid = make_grid(images, prompts, rewards, columns=columns)
    tmp = f"{path}.tmp-{os.getpid()}.png"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        grid.save(tmp, format="PNG")
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None
    return grid
