"""Calling a policy for the velocity of a batch of latents: FLUX (packed latents, RoPE ids, guidance
embedding), Wan and SD3 (two-branch classifier-free guidance in one batch), Qwen-Image (packed latents, masked
text, true CFG rescaled to the conditional velocity's norm).

A velocity function is ``fn(latents (B, *shape) float32, sigma (B,) float32, conditioning) -> (B, *shape)
float32``. It converts sigmas to the timestep the policy's forward expects (the diffusers pipeline
convention of :mod:`leangrpo_mcore.diffusion.sigmas`), casts the inputs to the policy's compute dtype and
returns float32, so that the SDE math downstream always runs in float32. ``reference()`` is a context in
which the policy runs with its LoRA adapters disabled: the KL reference of FlowGRPO.

Sampler latents of FLUX and Qwen-Image are *packed* (B, (H/2)·(W/2), 4·C), exactly as FluxPipeline and
QwenImagePipeline keep them; use :func:`pack_flux_latents` / :func:`unpack_flux_latents` at the VAE boundary.

Image conditioning (``conditioning.reference_latents``) is each family's business here, the second half of its
reference hook (the first, :mod:`leangrpo_mcore.data.reference`, encodes the image): FLUX.1-Kontext appends the
reference tokens to the noisy ones in every forward, with RoPE ids whose first component is 1
(FluxKontextPipeline's), and keeps the velocity of the generated tokens only, so that the SDE step, the log-probs
and the KL never see the reference.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Protocol

import torch

from leangrpo_mcore.diffusion.sigmas import SIGMA_KINDS, timesteps_from_sigmas, transformer_timestep
from leangrpo_mcore.diffusion.trajectory import Conditioning


class VelocityFn(Protocol):
    """What the sampler and the schedules call."""

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B, *shape) float32 velocity at per-sample ``sigma`` (B,)."""

    def reference(self) -> contextlib.AbstractContextManager:
        """Context in which calls evaluate the reference policy (adapters disabled)."""


def pack_flux_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) VAE latents → (B, (H/2)·(W/2), 4·C) tokens of 2×2 patches (FluxPipeline's packing)."""
    if latents.ndim != 4 or latents.shape[2] % 2 or latents.shape[3] % 2:
        raise ValueError(f"FLUX latents must be (B, C, H, W) with even H and W, got {tuple(latents.shape)}")
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_flux_latents(packed: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
    """Inverse of :func:`pack_flux_latents` for a (latent_height, latent_width) VAE latent grid."""
    b, seq, dim = packed.shape
    h, w = latent_height // 2, latent_width // 2
    if seq != h * w or dim % 4:
        raise ValueError(f"packed latents {tuple(packed.shape)} do not fit a {latent_height}x{latent_width} grid")
    patches = packed.reshape(b, h, w, dim // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, dim // 4, latent_height, latent_width)


def flux_image_ids(latent_height: int, latent_width: int, device: torch.device | str = "cpu",
                   *, image_index: int = 0) -> torch.Tensor:
    """(S, 3) RoPE positions of the packed image tokens: (image_index, row, col), as FluxPipeline builds them
    (``image_index`` 0: the generated image; 1: FLUX.1-Kontext's reference image)."""
    rows = torch.arange(latent_height // 2, dtype=torch.float32, device=device)
    cols = torch.arange(latent_width // 2, dtype=torch.float32, device=device)
    ids = torch.zeros(latent_height // 2, latent_width // 2, 3, device=device)
    ids[..., 0] = float(image_index)
    ids[..., 1] = rows[:, None]
    ids[..., 2] = cols[None, :]
    return ids.reshape(-1, 3)


def _policy_dtype(policy: torch.nn.Module) -> torch.dtype:
    for param in policy.parameters():
        return param.dtype
    return torch.float32


def _check_sigma(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
    if sigma.shape != (latents.shape[0],):
        raise ValueError(f"sigma must be per-sample ({latents.shape[0]},), got {tuple(sigma.shape)}")
    return sigma


class _PolicyVelocity:
    """Shared plumbing: timestep conversion, dtype, reference context."""

    family = ""

    def __init__(self, policy: torch.nn.Module, *, sigma_kind: str, compute_dtype: torch.dtype | None = None):
        if sigma_kind not in SIGMA_KINDS:
            raise ValueError(f"unknown sigma schedule {sigma_kind!r}; valid: {', '.join(SIGMA_KINDS)}")
        self.policy = policy
        self.sigma_kind = sigma_kind
        self.compute_dtype = compute_dtype or _policy_dtype(policy)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The (B,) timestep the policy's forward receives for per-sample ``sigma``."""
        scheduler_t = timesteps_from_sigmas(sigma, self.sigma_kind)
        return transformer_timestep(scheduler_t, self.family, dtype=self.compute_dtype)

    def finished(self, latents: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """The finished samples of a rollout's final ``latents`` (B, *shape): what is decoded (the latents
        themselves; Wan's first-frame image-to-video puts the image frame in front)."""
        return latents

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Evaluate the reference policy: the same weights with every LoRA adapter disabled."""
        from leangrpo_mcore.models.common.lora import disable_adapters, iter_lora_hosts

        if next(iter_lora_hosts(self.policy), None) is None:
            raise ValueError("the KL reference is the policy without its LoRA adapters; this policy has none")
        with disable_adapters(self.policy):
            yield


class FluxVelocity(_PolicyVelocity):
    """Velocity of a FLUX policy on packed latents of a (latent_height, latent_width) VAE grid.

    The guidance embedding receives ``conditioning.guidance`` (B,) when present (FLUX.1-dev: 3.5); FLUX is
    guidance-distilled, so two-branch CFG is not offered here. With ``conditioning.reference_latents`` (FLUX.1-Kontext)
    the policy sees [noisy tokens, reference tokens] and the velocity is that of the noisy tokens (module doc).
    """

    family = "flux"

    def __init__(self, policy: torch.nn.Module, *, latent_height: int, latent_width: int, sigma_kind: str = "flux",
                 compute_dtype: torch.dtype | None = None):
        super().__init__(policy, sigma_kind=sigma_kind, compute_dtype=compute_dtype)
        self.latent_height, self.latent_width = latent_height, latent_width

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B, S, 4·C) float32 velocity of packed ``latents`` (B, S, 4·C)."""
        return self.velocity_from_output(self.policy(**self.policy_inputs(latents, sigma, conditioning)))

    def policy_inputs(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> dict:
        """The keyword arguments of the policy forward for these latents."""
        sigma = _check_sigma(latents, sigma)
        if conditioning.negative_encoder_hidden_states is not None:
            raise ValueError("FLUX uses the guidance embedding; negative prompts (two-branch CFG) are not supported")
        if conditioning.pooled_projections is None:
            raise ValueError("FLUX needs conditioning.pooled_projections")
        device, dtype = latents.device, self.compute_dtype
        guidance = conditioning.guidance
        tokens, ids = latents.to(dtype), flux_image_ids(self.latent_height, self.latent_width, device)
        reference = conditioning.reference_latents
        if reference is not None:
            if reference.shape[1:] != latents.shape[1:]:
                raise ValueError(f"FLUX.1-Kontext reference tokens {tuple(reference.shape[1:])} must match the "
                                 f"generated ones {tuple(latents.shape[1:])}: the image is read at the run's size")
            tokens = torch.cat([tokens, reference.to(dtype)], dim=1)
            ids = torch.cat([ids, flux_image_ids(self.latent_height, self.latent_width, device, image_index=1)])
        return dict(
            hidden_states=tokens,
            encoder_hidden_states=conditioning.encoder_hidden_states.to(dtype),
            pooled_projections=conditioning.pooled_projections.to(dtype),
            timestep=self.timestep(sigma),
            img_ids=ids,
            txt_ids=torch.zeros(conditioning.encoder_hidden_states.shape[1], 3, device=device),
            guidance=None if guidance is None else guidance.to(torch.float32),
        )

    @property
    def generated_tokens(self) -> int:
        """Tokens of the generated image (the first ones of the policy's output)."""
        return (self.latent_height // 2) * (self.latent_width // 2)

    def velocity_from_output(self, out: torch.Tensor) -> torch.Tensor:
        """The float32 velocity of the generated tokens of the policy's output."""
        return out[:, :self.generated_tokens].to(torch.float32)


class WanVelocity(_PolicyVelocity):
    """Velocity of a Wan policy on (B, C, F, H, W) latents, with two-branch CFG when ``cfg_scale > 1``.

    The unconditional (``conditioning.negative_encoder_hidden_states``) and conditional branches run as
    one batch [uncond; cond] — one forward, one graph — and are combined in float32 as
    v = v_u + s·(v_c − v_u), the diffusers Wan pipeline's formula.

    Image-to-video, as ``WanImageToVideoPipeline`` feeds its transformer: a channel-concatenated checkpoint (its
    ``in_channels`` exceed its ``out_channels``) reads ``conditioning.reference_latents`` (first-frame mask and image
    latents) after the noisy latents along the channels, and a Wan2.1-I2V checkpoint the CLIP tokens
    ``conditioning.image_embeds``, in both CFG branches. With ``first_frame`` (Wan2.2-TI2V's image-to-video) the
    latents are the frames to generate: the image's latent frame (``conditioning.reference_latents``, F' = 1) is put
    in front of them, its tokens get timestep 0 and the others the step's, and the velocity returned is the
    generated frames' (the image frame is never sampled).
    """

    family = "wan"

    def __init__(self, policy: torch.nn.Module, *, sigma_kind: str = "wan", cfg_scale: float = 1.0,
                 compute_dtype: torch.dtype | None = None, first_frame: bool = False):
        super().__init__(policy, sigma_kind=sigma_kind, compute_dtype=compute_dtype)
        if cfg_scale < 1.0:
            raise ValueError(f"cfg_scale must be >= 1 (1 disables CFG), got {cfg_scale}")
        self.cfg_scale = float(cfg_scale)
        self.first_frame = first_frame

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B, C, F, H, W) float32 velocity."""
        return self.velocity_from_output(self.policy(**self.policy_inputs(latents, sigma, conditioning)))

    def _image_inputs(self, latents: torch.Tensor, timestep: torch.Tensor,
                      conditioning: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """(the policy's hidden states, its timestep) with the conditioning image put where the policy reads it."""
        dtype, image, config = self.compute_dtype, conditioning.reference_latents, getattr(self.policy, "config", None)
        hidden = latents.to(dtype)
        if self.first_frame:
            if image is None or image.shape[2] != 1:
                raise ValueError("image-to-video from the first frame needs conditioning.reference_latents (B, C, 1, h, w)")
            if config.patch_size[0] != 1:
                raise ValueError("image-to-video from the first frame needs a temporal patch of 1 (Wan2.2-TI2V's)")
            hidden = torch.cat([image.to(dtype), hidden], dim=2)
            per_frame = math.prod(s // p for s, p in zip(hidden.shape[3:], config.patch_size[1:]))
            noisy = torch.ones(hidden.shape[2], per_frame, device=timestep.device)
            noisy[0] = 0.0  # the image frame's tokens: timestep 0
            return hidden, noisy.flatten()[None] * timestep[:, None]
        wanted = getattr(config, "condition_channels", 0)
        if wanted:
            if image is None or image.shape[1] != wanted:
                got = None if image is None else tuple(image.shape)
                raise ValueError(f"this Wan I2V checkpoint reads {wanted} conditioning channels beside the noisy "
                                 f"latents: conditioning.reference_latents must be (B, {wanted}, F', h, w), got {got}")
            hidden = torch.cat([hidden, image.to(dtype)], dim=1)
        elif image is not None:
            raise ValueError("conditioning.reference_latents given to a text-to-video Wan policy without first_frame")
        return hidden, timestep

    def policy_inputs(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> dict:
        """The keyword arguments of the policy forward: the batch, or [uncond; cond] under CFG."""
        sigma = _check_sigma(latents, sigma)
        dtype = self.compute_dtype
        context = conditioning.encoder_hidden_states.to(dtype)
        hidden, timestep = self._image_inputs(latents, self.timestep(sigma), conditioning)
        clip = conditioning.image_embeds
        extra = {} if clip is None else {"encoder_hidden_states_image": clip.to(dtype)}
        if self.cfg_scale == 1.0:
            return dict(hidden_states=hidden, timestep=timestep, encoder_hidden_states=context, **extra)
        negative = conditioning.negative_encoder_hidden_states
        if negative is None:
            raise ValueError(f"cfg_scale {self.cfg_scale} needs conditioning.negative_encoder_hidden_states")
        extra = {key: torch.cat([value, value]) for key, value in extra.items()}
        return dict(hidden_states=torch.cat([hidden, hidden]), timestep=torch.cat([timestep, timestep]),
                    encoder_hidden_states=torch.cat([negative.to(dtype), context]), **extra)

    def finished(self, latents: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """The finished videos: with ``first_frame`` the image's latent frame and the generated ones after it."""
        if not self.first_frame:
            return latents
        return torch.cat([conditioning.reference_latents.to(latents.device, latents.dtype), latents], dim=2)

    def velocity_from_output(self, out: torch.Tensor) -> torch.Tensor:
        """The float32 velocity of the policy's output (the CFG combination of both branches; with
        ``first_frame`` the generated frames only)."""
        out = out[:, :, 1:] if self.first_frame else out
        if self.cfg_scale == 1.0:
            return out.to(torch.float32)
        uncond, cond = out.to(torch.float32).chunk(2)
        return uncond + self.cfg_scale * (cond - uncond)


class SD3Velocity(WanVelocity):
    """Velocity of an SD3 policy on (B, C, H, W) latents, with Wan's two-branch CFG when ``cfg_scale > 1``.

    SD3 has no guidance embedding: StableDiffusion3Pipeline runs [uncond; cond] in one batch, the negative
    branch reading the negative prompt's tokens *and* pooled vector (``conditioning.negative_*``), and combines
    them as Wan does.
    """

    family = "sd3"

    def __init__(self, policy: torch.nn.Module, *, sigma_kind: str = "sd3", cfg_scale: float = 1.0,
                 compute_dtype: torch.dtype | None = None):
        super().__init__(policy, sigma_kind=sigma_kind, cfg_scale=cfg_scale, compute_dtype=compute_dtype)

    def policy_inputs(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> dict:
        """The keyword arguments of the policy forward: the batch, or [uncond; cond] under CFG."""
        sigma = _check_sigma(latents, sigma)
        if conditioning.pooled_projections is None:
            raise ValueError("SD3 needs conditioning.pooled_projections")
        dtype, timestep = self.compute_dtype, self.timestep(sigma)
        batch = latents.to(dtype)
        context, pooled = conditioning.encoder_hidden_states.to(dtype), conditioning.pooled_projections.to(dtype)
        if self.cfg_scale == 1.0:
            return dict(hidden_states=batch, encoder_hidden_states=context, pooled_projections=pooled,
                        timestep=timestep)
        negative = conditioning.negative_encoder_hidden_states
        negative_pooled = conditioning.negative_pooled_projections
        if negative is None or negative_pooled is None:
            raise ValueError(f"cfg_scale {self.cfg_scale} needs conditioning.negative_encoder_hidden_states and "
                             "negative_pooled_projections")
        return dict(hidden_states=torch.cat([batch, batch]),
                    encoder_hidden_states=torch.cat([negative.to(dtype), context]),
                    pooled_projections=torch.cat([negative_pooled.to(dtype), pooled]),
                    timestep=torch.cat([timestep, timestep]))


class QwenImageVelocity(_PolicyVelocity):
    """Velocity of a Qwen-Image policy on packed latents of a (latent_height, latent_width) VAE grid.

    The text tokens come with their mask (``conditioning.encoder_attention_mask``). With ``cfg_scale > 1`` (the
    pipeline's ``true_cfg_scale``) the negative and the conditional branch run as one batch [uncond; cond] and
    combine in float32 as QwenImagePipeline does: v = v_u + s·(v_c − v_u), rescaled per token to the norm of v_c
    (``v · ‖v_c‖ / ‖v‖`` over the packed channels). Without it the policy runs guidance-less (the model has no
    guidance embedding).
    """

    family = "qwen_image"

    def __init__(self, policy: torch.nn.Module, *, latent_height: int, latent_width: int,
                 sigma_kind: str = "qwen_image", cfg_scale: float = 1.0, compute_dtype: torch.dtype | None = None):
        super().__init__(policy, sigma_kind=sigma_kind, compute_dtype=compute_dtype)
        if cfg_scale < 1.0:
            raise ValueError(f"cfg_scale must be >= 1 (1 disables CFG), got {cfg_scale}")
        if latent_height % 2 or latent_width % 2:
            raise ValueError(f"Qwen-Image packs 2x2 latents: the latent grid {latent_height}x{latent_width} must be "
                             "even")
        self.grid = (1, latent_height // 2, latent_width // 2)
        self.cfg_scale = float(cfg_scale)

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B, S, 4·C) float32 velocity of packed ``latents`` (B, S, 4·C)."""
        return self.velocity_from_output(self.policy(**self.policy_inputs(latents, sigma, conditioning)))

    def policy_inputs(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> dict:
        """The keyword arguments of the policy forward: the batch, or [uncond; cond] under CFG."""
        sigma = _check_sigma(latents, sigma)
        dtype, timestep, batch = self.compute_dtype, self.timestep(sigma), latents.to(self.compute_dtype)
        tokens, mask = conditioning.encoder_hidden_states.to(dtype), conditioning.encoder_attention_mask
        if self.cfg_scale == 1.0:
            return dict(hidden_states=batch, encoder_hidden_states=tokens, encoder_hidden_states_mask=mask,
                        timestep=timestep, img_shapes=self.grid)
        negative = conditioning.negative_encoder_hidden_states
        negative_mask = conditioning.negative_encoder_attention_mask
        if negative is None:
            raise ValueError(f"cfg_scale {self.cfg_scale} needs conditioning.negative_encoder_hidden_states")
        if negative.shape[1] != tokens.shape[1]:
            raise ValueError(f"the negative prompt has {negative.shape[1]} text tokens, the prompts "
                             f"{tokens.shape[1]}: both branches of one batch need the same length")
        both = None
        if mask is not None or negative_mask is not None:
            ones = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
            both = torch.cat([ones if negative_mask is None else negative_mask, ones if mask is None else mask])
        return dict(hidden_states=torch.cat([batch, batch]),
                    encoder_hidden_states=torch.cat([negative.to(dtype), tokens]), encoder_hidden_states_mask=both,
                    timestep=torch.cat([timestep, timestep]), img_shapes=self.grid)

    def velocity_from_output(self, out: torch.Tensor) -> torch.Tensor:
        """The float32 velocity of the policy's output (true CFG of both branches, norm-rescaled)."""
        if self.cfg_scale == 1.0:
            return out.to(torch.float32)
        uncond, cond = out.to(torch.float32).chunk(2)
        combined = uncond + self.cfg_scale * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class SplitVelocity:
    """A velocity function on this rank's pieces of the latents (context parallelism, ``parallel.cp``).

    The pieces of the CP group are gathered into whole latents, the policy runs its sequence-parallel forward
    (each rank computing its own tokens) and this rank keeps its piece of the velocity. The gradient reaches
    the velocity only through that piece; the policy's output gather sums the CP ranks' gradients.
    """

    def __init__(self, inner: VelocityFn, split) -> None:
        self.inner, self.split = inner, split

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B, n_local) float32 velocity of the pieces ``latents`` (B, n_local)."""
        return self.split.shard(self.inner(self.split.gather(latents), sigma, conditioning))

    def reference(self) -> contextlib.AbstractContextManager:
        """The inner function's reference context."""
        return self.inner.reference()


def finish_latents(velocity_fn, latents: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
    """``finished`` of the family's velocity function inside ``velocity_fn`` (which may wrap it: context
    parallelism, pipeline stages): the samples to decode from whole final latents."""
    inner = velocity_fn
    while not hasattr(inner, "finished") and hasattr(inner, "inner"):
        inner = inner.inner
    return inner.finished(latents, conditioning) if hasattr(inner, "finished") else latents


def build_velocity_fn(
    family: str,
    policy: torch.nn.Module,
    *,
    sigma_kind: str,
    latent_height: int = 0,
    latent_width: int = 0,
    cfg_scale: float = 1.0,
    first_frame: bool = False,
) -> FluxVelocity | WanVelocity | QwenImageVelocity:
    """The velocity function of a ``flux``, ``sd3``, ``wan`` or ``qwen_image`` policy (latent grid sizes are the
    VAE latent grid of the packed families, FLUX and Qwen-Image; ``first_frame``: Wan's first-frame
    image-to-video)."""
    if family == "flux":
        if cfg_scale != 1.0:
            raise ValueError("FLUX uses the guidance embedding; set sampler.cfg_scale to 1")
        return FluxVelocity(policy, latent_height=latent_height, latent_width=latent_width, sigma_kind=sigma_kind)
    if family == "wan":
        return WanVelocity(policy, sigma_kind=sigma_kind, cfg_scale=cfg_scale, first_frame=first_frame)
    if family == "sd3":
        return SD3Velocity(policy, sigma_kind=sigma_kind, cfg_scale=cfg_scale)
    if family == "qwen_image":
        return QwenImageVelocity(policy, latent_height=latent_height, latent_width=latent_width,
                                 sigma_kind=sigma_kind, cfg_scale=cfg_scale)
    raise ValueError(f"unknown policy family {family!r}; valid: flux, sd3, wan, qwen_image")
