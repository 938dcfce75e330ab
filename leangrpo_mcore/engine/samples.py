"""Sample grids: generated images side by side, each captioned with its prompt and reward (PIL).

Video samples are shown by their first frame. Images are float tensors in [0, 1]; the grid is written through a
temporary file and a rename, so a killed run never leaves a truncated PNG.
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

CAPTION_LINES = 3
_LINE_HEIGHT = 12


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


def _caption(prompt: str, reward: float, width_chars: int) -> list[str]:
    lines = textwrap.wrap(prompt, width=max(width_chars, 8)) or [""]
    lines = lines[: CAPTION_LINES - 1]
    lines.append(f"reward {reward:.4g}")
    return lines


def make_grid(images: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float], *,
              columns: int = 4) -> Image.Image:
    """A PIL image: a grid of the samples, each with its prompt (wrapped) and reward written under it."""
    frames = to_uint8(first_frames(images))
    count = frames.shape[0]
    if len(prompts) != count or len(rewards) != count:
        raise ValueError(f"make_grid: {count} images but {len(prompts)} prompts and {len(rewards)} rewards")
    if count == 0:
        raise ValueError("make_grid needs at least one image")
    height, width = frames.shape[1:3]
    # Tiny CPU images are upscaled so that the caption is readable next to them.
    scale = max(1, math.ceil(128 / max(width, 1)))
    cell_w, cell_h = width * scale, height * scale
    cols = max(1, min(columns, count))
    rows = math.ceil(count / cols)
    caption_h = CAPTION_LINES * _LINE_HEIGHT + 4
    canvas = Image.new("RGB", (cols * (cell_w + 4), rows * (cell_h + caption_h + 4)), "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    for i in range(count):
        x = (i % cols) * (cell_w + 4) + 2
        y = (i // cols) * (cell_h + caption_h + 4) + 2
        tile = Image.fromarray(frames[i]).resize((cell_w, cell_h), Image.NEAREST)
        canvas.paste(tile, (x, y))
        for k, line in enumerate(_caption(str(prompts[i]), float(rewards[i]), cell_w // 6)):
            draw.text((x, y + cell_h + 2 + k * _LINE_HEIGHT), line, fill="black", font=font)
    return canvas


def save_grid(path: str, images: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float], *,
              columns: int = 4) -> Image.Image:
    """Write :func:`make_grid` to ``path`` (PNG) atomically; returns the image."""
    grid = make_grid(images, prompts, rewards, columns=columns)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.png"
    grid.save(tmp, format="PNG")
    os.replace(tmp, path)
    return grid
