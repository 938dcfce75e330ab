"""The first half of a family's image-conditioning hook: a conditioning image encoded into the policy's inputs.

A policy family that takes a conditioning image registers a :class:`ReferenceEncoder`::

    register_reference_encoder("flux", ReferenceEncoder(encode=kontext, shapes=kontext_shapes))

``encode(decoder, images)`` receives the VAE of the run and the images (n, 3, H, W) float32 in [0, 1] at the run's
resolution (one per prompt group: every generation of a group shares its encoding) and returns
:class:`~leangrpo_mcore.diffusion.trajectory.Conditioning` fields, batch first, which ride with the text
conditioning through the sampler, the trajectories and every schedule; ``shapes(latent_shape)`` says the
per-sample shape of each field for a policy latent of ``latent_shape`` (what the step simulator allocates). A family
whose encoding depends on the checkpoint and the run registers ``bind(run)`` instead, which returns the encoder of
a :class:`ReferenceRun` (Wan: the image-to-video layout of the checkpoint and the run's frame count). The
second half is the family's velocity function (:mod:`leangrpo_mcore.diffusion.velocity`): how the policy's forward
sees those fields and which of its output tokens are generated. docs/architecture.md lists both under the
extension points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from leangrpo_mcore.data.vae import LatentDecoder
from leangrpo_mcore.errors import UserError


@dataclass(frozen=True)
class ReferenceRun:
    """What an encoder may depend on beyond the images: the checkpoint and the run."""

    hyper: dict
    """The policy's diffusers-style hyper-parameters."""
    frames: int = 1
    """``sampler.frames``: pixel frames of a video."""
    image_encoder_path: Optional[str] = None
    """``model.image_encoder_path``: the CLIP image encoder of a checkpoint that reads CLIP image tokens."""
    reads_weights: bool = True
    """False for the step simulator, which allocates the fields in their shapes and encodes nothing (no encoder
    weights are needed then)."""


@dataclass(frozen=True)
class ReferenceEncoder:
    """How one family turns conditioning images into conditioning fields (module doc)."""

    encode: Optional[Callable[[LatentDecoder, torch.Tensor], "dict[str, torch.Tensor]"]] = None
    """``(decoder, images (n, 3, H, W) in [0, 1]) -> {Conditioning field: (n, ...) tensor}``."""
    shapes: Optional[Callable[[tuple[int, ...]], "dict[str, tuple[int, ...]]"]] = None
    """``(policy latent shape) -> {Conditioning field: per-sample shape}``."""
    bind: Optional[Callable[[ReferenceRun], "ReferenceEncoder"]] = None
    """``(run) -> the encoder of that run`` (UserError, one line, for a checkpoint or run it cannot condition),
    for a family whose encoding depends on them; None: ``encode`` and ``shapes`` serve every run."""

    def of(self, run: Optional[ReferenceRun]) -> "ReferenceEncoder":
        """The encoder of ``run``."""
        if self.bind is None:
            return self
        if run is None:
            raise ValueError("this family's reference encoder depends on the run: pass its ReferenceRun")
        return self.bind(run)


REFERENCE_ENCODERS: dict[str, ReferenceEncoder] = {}


def register_reference_encoder(family: str, encoder: ReferenceEncoder) -> ReferenceEncoder:
    """Register the reference encoder of policy family ``family``."""
    if family in REFERENCE_ENCODERS:
        raise ValueError(f"family {family!r} already has a reference encoder")
    REFERENCE_ENCODERS[family] = encoder
    return encoder


def check_image_conditioning(family: str, run: Optional[ReferenceRun] = None) -> ReferenceEncoder:
    """The reference encoder of policy family ``family`` (of ``run`` where the family's depends on it); UserError
    when it takes no conditioning image."""
    if family not in REFERENCE_ENCODERS:
        takes = ", ".join(sorted(REFERENCE_ENCODERS)) or "none"
        raise UserError(f"data.images=true: model.family={family} takes no conditioning image (families that do: "
                        f"{takes})")
    encoder = REFERENCE_ENCODERS[family]
    return encoder if run is None and encoder.bind is not None else encoder.of(run)


@torch.no_grad()
def encode_references(family: str, decoder: LatentDecoder, images: torch.Tensor,
                      run: Optional[ReferenceRun] = None) -> dict[str, torch.Tensor]:
    """The conditioning fields of ``images`` (n, 3, H, W) in [0, 1] for a policy of ``family``, float32."""
    encoder = check_image_conditioning(family).of(run)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"conditioning images must be (n, 3, H, W), got {tuple(images.shape)}")
    if run is not None and not run.reads_weights:
        raise ValueError("a simulated run's ReferenceRun encodes nothing")
    return {name: value.to(torch.float32) for name, value in encoder.encode(decoder, images).items()}


def reference_shapes(family: str, latent_shape: tuple[int, ...],
                     run: Optional[ReferenceRun] = None) -> dict[str, tuple[int, ...]]:
    """The per-sample shape of each conditioning field a policy of ``family`` and ``latent_shape`` receives."""
    return check_image_conditioning(family).of(run).shapes(tuple(latent_shape))


def _kontext(decoder: LatentDecoder, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """FLUX.1-Kontext: the image's VAE latent (the distribution's mode, normalised), packed into 2x2-patch tokens
    as the noisy latents are (FluxKontextPipeline's ``_encode_vae_image`` and ``_pack_latents``)."""
    return {"reference_latents": decoder.encode(images)}


register_reference_encoder("flux", ReferenceEncoder(encode=_kontext,
                                                    shapes=lambda shape: {"reference_latents": shape}))


def wan_reference_encoder(run: ReferenceRun) -> ReferenceEncoder:
    """Wan image-to-video (``data/wan_image.py``): a checkpoint whose input channels exceed its output channels reads
    the first-frame mask and the image latents of the run's video beside the noisy latents; one with as many
    (Wan2.2-TI2V-5B, trained for it) takes the image's latent frame in place of its first frame, and the sampler's
    latents are the frames after it. A checkpoint with ``image_dim`` (Wan2.1-I2V) also reads the image's CLIP tokens
    (``model.image_encoder_path``), in the ``image_embeds`` field."""
    from leangrpo_mcore.data.wan_image import ClipImageTokens, concat_condition, first_frame_condition

    channels, out = int(run.hyper["in_channels"]), int(run.hyper.get("out_channels") or run.hyper["in_channels"])
    clip = None
    if run.hyper.get("image_dim") is not None:
        if run.image_encoder_path is None and run.reads_weights:
            raise UserError("data.images=true: this Wan checkpoint also reads CLIP image tokens (image_dim): set "
                            "model.image_encoder_path to its CLIP image encoder (the pipeline directory with "
                            "image_encoder/ and image_processor/)")
        clip = ClipImageTokens(run.image_encoder_path, int(run.hyper["image_dim"]))
    elif run.image_encoder_path is not None:
        raise UserError("model.image_encoder_path is set, but this Wan checkpoint reads no CLIP image tokens "
                        "(no image_dim in its config)")
    temporal = int(run.hyper.get("vae_scale_factor_temporal") or 4)
    if channels > out:
        def encode(decoder: LatentDecoder, images: torch.Tensor) -> dict[str, torch.Tensor]:
            fields = {"reference_latents": concat_condition(decoder, images, run.frames, temporal)}
            return fields if clip is None else {**fields, "image_embeds": clip(images)}

        def shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
            fields = {"reference_latents": (channels - out, *shape[1:])}
            return fields if clip is None else {**fields, "image_embeds": clip.shape()}

        return ReferenceEncoder(encode=encode, shapes=shapes)
    if clip is not None:
        raise UserError("data.images=true: a Wan checkpoint that reads CLIP image tokens must also read the image "
                        "through its channels (in_channels > out_channels)")
    if (run.frames - 1) // temporal < 1:
        raise UserError(f"data.images=true: Wan's image takes the first latent frame, so a video needs frames to "
                        f"generate after it: sampler.frames >= {temporal + 1}, got {run.frames}")
    return ReferenceEncoder(encode=lambda decoder, images: {"reference_latents": first_frame_condition(decoder,
                                                                                                        images)},
                            shapes=lambda shape: {"reference_latents": (shape[0], 1, *shape[2:])})


register_reference_encoder("wan", ReferenceEncoder(bind=wan_reference_encoder))
