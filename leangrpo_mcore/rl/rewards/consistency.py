"""Rewards that compare each sample with its conditioning image (runs with ``data.images``).

- ``clip_consistency``: the cosine of the CLIP image embeddings of the sample and of its source image
  (transformers' ``CLIPModel`` from a local directory, preprocessed as the other CLIP rewards: the model's
  ``CLIPImageProcessor``). The "keep the rest" half of an instruction edit, combined with a text reward (the
  "follow the instruction" half, e.g. ``clip_score``) through ``weighted``.
- ``first_frame_consistency``: image-to-video's "the clip starts from the image": the PSNR in dB of the video's
  first frame against the source, 10·log10(1 / MSE) of pixels in [0, 1] (the mean squared error floored at
  1e-10, so an exact copy scores 100). It scores the frames that option ``frames`` picks, the first by default;
  with more, each against the source, averaged.

Both receive the source as ``reference_images`` (B, 3, H, W) in [0, 1], the image the policy was conditioned on.
"""

from typing import List, Optional

import torch
from torch import Tensor

from .clip_models import DEFAULT_BATCH_SIZE, check_batch_size, load_clip_encoder
from .registry import register_reward

MSE_FLOOR = 1e-10
"""Smallest mean squared error of ``first_frame_consistency`` (a PSNR of 100 dB)."""
_DOWNLOAD = "a CLIP model (CLIPModel with its processor, e.g. openai/clip-vit-large-patch14)"


def _references(reference_images: Optional[Tensor], images: Tensor, name: str) -> Tensor:
    """The checked sources of ``images``; ValueError without them (the run has no conditioning images)."""
    if reference_images is None:
        raise ValueError(f"{name} compares each sample with its conditioning image: set data.images=true")
    if reference_images.shape[0] != images.shape[0]:
        raise ValueError(f"{name}: {reference_images.shape[0]} reference images for {images.shape[0]} samples")
    return reference_images


@register_reward("clip_consistency")
class ClipConsistencyReward:
    """CLIP image-image cosine of each sample with its source (module doc)."""

    def __init__(self, path: Optional[str] = None, *, processor_path: Optional[str] = None,
                 device: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        """``path``: the ``CLIPModel`` directory; ``processor_path``: its preprocessor_config.json directory
        (default ``path``)."""
        self.batch_size = check_batch_size(batch_size)
        self.encoder = load_clip_encoder(path, processor_path, _DOWNLOAD, _DOWNLOAD, device, dtype, tokenizer=False)

    def __call__(self, images: Tensor, prompts: List[str], *, reference_images: Optional[Tensor] = None) -> Tensor:
        """Cosines (B,) float32 on the CPU of images (B, 3, H, W) in [0, 1] with their sources."""
        sources = _references(reference_images, images, "clip_consistency")
        parts = []
        with torch.no_grad():
            for start in range(0, images.shape[0], self.batch_size):
                chunk = slice(start, start + self.batch_size)
                parts.append((self.encoder.image_embeddings(images[chunk])
                              * self.encoder.image_embeddings(sources[chunk])).sum(-1))
        return torch.cat(parts).to(torch.float32).cpu()


@register_reward("first_frame_consistency")
def first_frame_consistency(images: Tensor, prompts: List[str], *,
                            reference_images: Optional[Tensor] = None) -> Tensor:
    """PSNR (B,) float32 in dB of each (first) frame against its source (module doc)."""
    sources = _references(reference_images, images, "first_frame_consistency")
    if sources.shape[1:] != images.shape[1:]:
        raise ValueError(f"first_frame_consistency: frames {tuple(images.shape[1:])} and reference images "
                         f"{tuple(sources.shape[1:])} differ in size")
    error = (images.double() - sources.to(images.device).double()).pow(2).flatten(1).mean(dim=1)
    return (10.0 * torch.log10(1.0 / error.clamp_min(MSE_FLOOR))).to(torch.float32).cpu()
