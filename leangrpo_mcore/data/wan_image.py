"""Wan image-to-video conditioning: what a conditioning image becomes before the policy sees it.

Two layouts, as diffusers' ``WanImageToVideoPipeline.prepare_latents`` builds them (computed once per prompt, shared
by its generations):

- **channel concatenation** (Wan2.1-I2V-14B, Wan2.2-I2V-A14B; the checkpoint's ``in_channels`` exceed its
  ``out_channels``): the image followed by mid-grey frames is VAE-encoded as a video of the run's length (the
  distribution's mode, normalised as the policy's latents are), and a first-frame mask is put in front: a channel
  per frame of the VAE's temporal group, 1 on the first pixel frame (repeated over its group) and 0 on every other
  frame. The policy reads ``[noisy latents, mask, image latents]`` along the channels at every step
  (:func:`concat_condition`).
- **first frame** (Wan2.2-TI2V-5B's ``expand_timesteps``): the image alone is encoded into one latent frame, which
  takes the place of the first latent frame; its tokens get timestep 0 (:func:`first_frame_condition`).

Wan2.1-I2V also reads the image through CLIP ViT-H/14: the penultimate hidden states of ``CLIPVisionModel`` on the
``CLIPImageProcessor`` view of the image (:func:`clip_image_tokens`, as the pipeline's ``encode_image``; a run
loads the encoder once per process, :class:`ClipImageTokens`). The pipeline hands CLIP the image as given and the
VAE the image resized to the video's size; a run reads each image once, at the run's resolution, and hands that to
both.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from leangrpo_mcore.data.vae import LatentDecoder
from leangrpo_mcore.errors import UserError

CLIP_VIT_H_TOKENS = 257
"""CLIP ViT-H/14's tokens at 224 px ((224 / 14)^2 patches and the class token): Wan2.1-I2V's image tokens, which a
simulation without the encoder's files allocates."""


def _check_images(images: torch.Tensor) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"conditioning images must be (B, 3, H, W) in [0, 1], got {tuple(images.shape)}")


def first_frame_mask(frames: int, height: int, width: int, temporal: int) -> torch.Tensor:
    """(temporal, F', h, w) float32 mask of a video of ``frames`` pixel frames on an (h, w) latent grid: the first
    latent frame's ``temporal`` channels are 1 (the image), every later one 0 (frames to generate)."""
    if frames < 1 or (frames - 1) % temporal:
        raise ValueError(f"Wan frames must be 1 + a multiple of {temporal}, got {frames}")
    mask = torch.zeros(1, frames + temporal - 1, height, width)
    mask[:, :temporal] = 1.0  # the first pixel frame, repeated over its temporal group
    return mask.view(-1, temporal, height, width).transpose(0, 1).contiguous()


@torch.no_grad()
def concat_condition(decoder: LatentDecoder, images: torch.Tensor, frames: int, temporal: int) -> torch.Tensor:
    """(B, temporal + C, F', h, w) float32: the first-frame mask and the latents of ``images`` (B, 3, H, W) in
    [0, 1] followed by ``frames`` - 1 mid-grey frames (0 in the VAE's [-1, 1] pixels, as the pipeline's zeros)."""
    _check_images(images)
    video = torch.full((images.shape[0], 3, frames, *images.shape[2:]), 0.5, dtype=torch.float32)
    video[:, :, 0] = images.float().cpu()
    latents = decoder.encode(video)
    mask = first_frame_mask(frames, latents.shape[-2], latents.shape[-1], temporal).to(latents.device)
    return torch.cat([mask.unsqueeze(0).expand(latents.shape[0], -1, -1, -1, -1), latents], dim=1)


@torch.no_grad()
def first_frame_condition(decoder: LatentDecoder, images: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, h, w) float32: the latent frame of ``images`` (B, 3, H, W) in [0, 1] alone."""
    _check_images(images)
    return decoder.encode(images.unsqueeze(2))


@torch.no_grad()
def clip_image_tokens(encoder: torch.nn.Module, processor, images: torch.Tensor) -> torch.Tensor:
    """(B, I, width) float32 penultimate hidden states of transformers' ``CLIPVisionModel`` ``encoder`` on the
    ``processor`` (``CLIPImageProcessor``) view of ``images`` (B, 3, H, W) in [0, 1], quantised to 8-bit pixels
    as an image file holds them."""
    from PIL import Image

    _check_images(images)
    pixels = (images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    inputs = processor(images=[Image.fromarray(p) for p in pixels], return_tensors="pt")
    device = next(encoder.parameters()).device
    out = encoder(pixel_values=inputs["pixel_values"].to(device, next(encoder.parameters()).dtype),
                  output_hidden_states=True)
    return out.hidden_states[-2].float()


def _clip_dirs(path: str) -> tuple[Path, Path]:
    """(the CLIPVisionModel directory, the CLIPImageProcessor directory) of ``model.image_encoder_path``: a pipeline
    directory's ``image_encoder/`` and ``image_processor/``, or the directory itself for both; UserError without an
    encoder's config.json there."""
    root = Path(path)
    encoder, processor = root, root
    if (root / "image_encoder").is_dir():
        encoder = root / "image_encoder"
        processor = root / "image_processor" if (root / "image_processor").is_dir() else encoder
    if not (encoder / "config.json").is_file():
        raise UserError(f"model.image_encoder_path={path}: no CLIP image encoder there (no config.json in {encoder}, "
                        "nor an image_encoder/ folder)")
    return encoder, processor


@functools.lru_cache(maxsize=2)
def _load_clip(path: str, device: str) -> tuple[torch.nn.Module, object]:
    """The CLIP vision encoder (float32, eval) and its image processor at ``path``, once per process and device."""
    import importlib.util

    import transformers

    # the class the pipeline loads; without torchvision transformers falls back to the PIL backend (and says so)
    processor_class = transformers.CLIPImageProcessor if importlib.util.find_spec("torchvision") \
        else transformers.CLIPImageProcessorPil
    encoder_dir, processor_dir = _clip_dirs(path)
    try:
        encoder = transformers.CLIPVisionModel.from_pretrained(str(encoder_dir), dtype=torch.float32)
        processor = processor_class.from_pretrained(str(processor_dir))
    except (OSError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"model.image_encoder_path={path}: no CLIP image encoder could be loaded there: "
                        f"{reason}") from None
    return encoder.eval().requires_grad_(False).to(device), processor


class ClipImageTokens:
    """A run's CLIP image tokens of its conditioning images (Wan2.1-I2V), from ``model.image_encoder_path``."""

    def __init__(self, path: Optional[str], width: int) -> None:
        """``width``: the checkpoint's ``image_dim``, which the encoder's hidden size must equal."""
        self.path, self.width = path, width

    def shape(self) -> tuple[int, int]:
        """(tokens, width) of one image: from the encoder's config where the path is given (no weights read), else
        CLIP ViT-H/14's 257."""
        if self.path is None:
            return CLIP_VIT_H_TOKENS, self.width
        import transformers

        encoder_dir = _clip_dirs(self.path)[0]
        try:
            config = transformers.CLIPVisionConfig.from_pretrained(str(encoder_dir))
        except (OSError, ValueError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"model.image_encoder_path={self.path}: no CLIP vision config there: {reason}") from None
        if config.hidden_size != self.width:
            raise UserError(f"model.image_encoder_path={self.path}: its hidden size {config.hidden_size} is not the "
                            f"checkpoint's image_dim {self.width}")
        return (config.image_size // config.patch_size) ** 2 + 1, self.width

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """(B, I, width) float32 tokens of ``images`` (B, 3, H, W) in [0, 1] (:func:`clip_image_tokens`)."""
        if self.path is None:
            raise ValueError("CLIP image tokens need model.image_encoder_path")
        self.shape()  # the width check, one line
        encoder, processor = _load_clip(self.path, str(images.device))
        return clip_image_tokens(encoder, processor, images)
