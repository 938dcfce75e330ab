"""The first half of a family's image-conditioning hook: a conditioning image encoded into the policy's inputs.

A policy family that takes a conditioning image registers a :class:`ReferenceEncoder`::

    register_reference_encoder("flux", ReferenceEncoder(encode=kontext, shapes=kontext_shapes))

``encode(decoder, images)`` receives the VAE of the run and the images (n, 3, H, W) float32 in [0, 1] at the run's
resolution (one per prompt group: every generation of a group shares its encoding) and returns
:class:`~leangrpo_mcore.diffusion.trajectory.Conditioning` fields, batch first, which ride with the text
conditioning through the sampler, the trajectories and every schedule; ``shapes(latent_shape)`` says the
per-sample shape of each field for a policy latent of ``latent_shape`` (what the step simulator allocates). The
second half is the family's velocity function (:mod:`leangrpo_mcore.diffusion.velocity`): how the policy's forward
sees those fields and which of its output tokens are generated. docs/architecture.md lists both under the
extension points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from leangrpo_mcore.data.vae import LatentDecoder
from leangrpo_mcore.errors import UserError


@dataclass(frozen=True)
class ReferenceEncoder:
    """How one family turns conditioning images into conditioning fields (module doc)."""

    encode: Callable[[LatentDecoder, torch.Tensor], "dict[str, torch.Tensor]"]
    """``(decoder, images (n, 3, H, W) in [0, 1]) -> {Conditioning field: (n, ...) tensor}``."""
    shapes: Callable[[tuple[int, ...]], "dict[str, tuple[int, ...]]"]
    """``(policy latent shape) -> {Conditioning field: per-sample shape}``."""


REFERENCE_ENCODERS: dict[str, ReferenceEncoder] = {}


def register_reference_encoder(family: str, encoder: ReferenceEncoder) -> ReferenceEncoder:
    """Register the reference encoder of policy family ``family``."""
    if family in REFERENCE_ENCODERS:
        raise ValueError(f"family {family!r} already has a reference encoder")
    REFERENCE_ENCODERS[family] = encoder
    return encoder


def check_image_conditioning(family: str) -> ReferenceEncoder:
    """The reference encoder of policy family ``family``; UserError when it takes no conditioning image."""
    if family not in REFERENCE_ENCODERS:
        takes = ", ".join(sorted(REFERENCE_ENCODERS)) or "none"
        raise UserError(f"data.images=true: model.family={family} takes no conditioning image (families that do: "
                        f"{takes})")
    return REFERENCE_ENCODERS[family]


@torch.no_grad()
def encode_references(family: str, decoder: LatentDecoder, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """The conditioning fields of ``images`` (n, 3, H, W) in [0, 1] for a policy of ``family``, float32."""
    encoder = check_image_conditioning(family)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"conditioning images must be (n, 3, H, W), got {tuple(images.shape)}")
    return {name: value.to(torch.float32) for name, value in encoder.encode(decoder, images).items()}


def reference_shapes(family: str, latent_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The per-sample shape of each conditioning field a policy of ``family`` and ``latent_shape`` receives."""
    return check_image_conditioning(family).shapes(tuple(latent_shape))


def _kontext(decoder: LatentDecoder, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """FLUX.1-Kontext: the image's VAE latent (the distribution's mode, normalised), packed into 2x2-patch tokens
    as the noisy latents are (FluxKontextPipeline's ``_encode_vae_image`` and ``_pack_latents``)."""
    return {"reference_latents": decoder.encode(images)}


register_reference_encoder("flux", ReferenceEncoder(encode=_kontext,
                                                    shapes=lambda shape: {"reference_latents": shape}))
