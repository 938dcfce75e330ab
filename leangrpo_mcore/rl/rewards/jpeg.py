"""JPEG (in)compressibility rewards (DDPO, Black et al. 2023, ``ddpo_pytorch/rewards.py``).

The image is encoded as JPEG at quality 95 with PIL; its size in kB (bytes / 1000) is the
incompressibility, and minus that size the compressibility.
"""

import io
from typing import List

import torch
from PIL import Image
from torch import Tensor

from .base import images_to_uint8
from .registry import register_reward

DDPO_JPEG_QUALITY = 95


def jpeg_sizes_kb(images: Tensor, *, quality: int = DDPO_JPEG_QUALITY) -> Tensor:
    """JPEG-encoded size in kB (bytes / 1000) of each image of (B, 3, H, W) in [0, 1]; float32 (B,)."""
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
    sizes = []
    for pixels in images_to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(images: Tensor, prompts: List[str], *, quality: int = DDPO_JPEG_QUALITY) -> Tensor:
    """−(JPEG size in kB): higher for images that compress well (DDPO's ``jpeg_compressibility``)."""
    return -jpeg_sizes_kb(images, quality=quality)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(images: Tensor, prompts: List[str], *, quality: int = DDPO_JPEG_QUALITY) -> Tensor:
    """+(JPEG size in kB): higher for detailed, hard-to-compress images (DDPO's ``jpeg_incompressibility``)."""
    return jpeg_sizes_kb(images, quality=quality)
