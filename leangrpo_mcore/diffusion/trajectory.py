"""Rollout records: the conditioning of a batch and the trajectories it produced.

Only tensors cross the rollout → reward → update boundary (STYLE.md); both dataclasses check their
shapes on construction and keep the batch dimension first so that ``select``/``split``/``cat`` are one
indexing operation per field.

Memory: latents are stored in float32 (docs/algorithms.md §7), so the update evaluates log p at exactly the
x_{t+1} the rollout drew; a trajectory costs about 2·T + 1 latents per sample (``latents``,
``next_latents``, ``final_latents``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

Indices = Sequence[int] | torch.Tensor


def _index_tensor(indices: Indices, batch: int) -> torch.Tensor:
    """1-D long tensor of sample indices, each in [0, batch)."""
    raw = indices if isinstance(indices, torch.Tensor) else torch.tensor(list(indices), dtype=torch.long)
    if raw.ndim != 1 or raw.dtype == torch.bool or raw.is_floating_point():
        raise ValueError(f"indices must be a 1-D sequence of ints, got {raw.dtype} of shape {tuple(raw.shape)}")
    index = raw.to(torch.long)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch):
        raise ValueError(f"indices must lie in [0, {batch}), got {index.tolist()}")
    return index


def _take(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor.index_select(0, index.to(tensor.device))


def _check_batch(name: str, tensor: torch.Tensor, ndim: int, batch: int) -> None:
    if tensor.ndim != ndim or tensor.shape[0] != batch:
        raise ValueError(f"{name} must have {ndim} dims with batch {batch} first, got shape {tuple(tensor.shape)}")


@dataclass
class Conditioning:
    """Conditioning of B samples (text, and a conditioning image); every field has the batch dimension first."""

    encoder_hidden_states: torch.Tensor
    """(B, L, D) text-encoder tokens (T5 for FLUX and Wan)."""
    pooled_projections: torch.Tensor | None = None
    """(B, P) pooled text embedding (CLIP for FLUX), or None."""
    negative_encoder_hidden_states: torch.Tensor | None = None
    """(B, L, D) negative-prompt tokens for classifier-free guidance, or None without CFG."""
    guidance: torch.Tensor | None = None
    """(B,) distilled-guidance scale (FLUX-dev), or None."""
    negative_pooled_projections: torch.Tensor | None = None
    """(B, P) pooled embedding of the negative prompt (SD3's classifier-free guidance), or None."""
    reference_latents: torch.Tensor | None = None
    """(B, ...) float32 conditioning image of each sample as its family's reference encoder makes it
    (:mod:`leangrpo_mcore.data.reference`; FLUX.1-Kontext: packed VAE tokens (B, S_ref, 4·C); Wan: the first-frame
    mask and image latents (B, 4 + C, F', h, w) a channel-concatenated image-to-video checkpoint reads beside the
    noisy latents, or Wan2.2-TI2V's first latent frame (B, C, 1, h, w)), or None without image conditioning. The
    family's velocity function decides how the policy sees it."""
    image_embeds: torch.Tensor | None = None
    """(B, I, D) CLIP tokens of the conditioning image (Wan2.1-I2V), or None."""
    encoder_attention_mask: torch.Tensor | None = None
    """(B, L) bool, True for the real tokens of ``encoder_hidden_states`` (Qwen-Image pads its prompts to the
    longest), or None: every token is real."""
    negative_encoder_attention_mask: torch.Tensor | None = None
    """(B, L) bool, the same for ``negative_encoder_hidden_states``, or None."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_samples(self) -> int:
        """Batch size B."""
        return self.encoder_hidden_states.shape[0]

    def validate(self) -> None:
        """Raise ValueError unless every present field has its documented rank and batch size."""
        if self.encoder_hidden_states.ndim != 3:
            raise ValueError(
                f"encoder_hidden_states must be (B, L, D), got shape {tuple(self.encoder_hidden_states.shape)}"
            )
        batch = self.num_samples
        for name, ndim in (("pooled_projections", 2), ("negative_encoder_hidden_states", 3), ("guidance", 1),
                           ("negative_pooled_projections", 2), ("image_embeds", 3)):
            value = getattr(self, name)
            if value is not None:
                _check_batch(f"conditioning.{name}", value, ndim, batch)
        reference = self.reference_latents
        if reference is not None and (reference.ndim < 2 or reference.shape[0] != batch):
            raise ValueError(f"conditioning.reference_latents must have batch {batch} first, got shape "
                             f"{tuple(reference.shape)}")
        for mask_name, tokens_name in (("encoder_attention_mask", "encoder_hidden_states"),
                                       ("negative_encoder_attention_mask", "negative_encoder_hidden_states")):
            mask, tokens = getattr(self, mask_name), getattr(self, tokens_name)
            if mask is not None and (tokens is None or mask.dtype != torch.bool
                                     or tuple(mask.shape) != tuple(tokens.shape[:2])):
                raise ValueError(f"conditioning.{mask_name} must be a bool (B, L) mask of {tokens_name}, got "
                                 f"{mask.dtype} of shape {tuple(mask.shape)}")

    def select(self, indices: Indices) -> Conditioning:
        """The conditioning of the samples at ``indices`` (in that order)."""
        index = _index_tensor(indices, self.num_samples)
        return Conditioning(**{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    def to(self, device: torch.device | str) -> Conditioning:
        """A copy with every tensor on ``device`` (dtypes kept: the masks stay bool)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Conditioning(**{k: None if v is None else v.to(device) for k, v in moved.items()})

    @classmethod
    def cat(cls, items: Sequence[Conditioning]) -> Conditioning:
        """Concatenate along the batch; every item must have the same optional fields present."""
        if not items:
            raise ValueError("Conditioning.cat needs at least one item")
        merged = {}
        for f in fields(cls):
            values = [getattr(item, f.name) for item in items]
            present = [v is not None for v in values]
            if any(present) and not all(present):
                raise ValueError(f"Conditioning.cat: conditioning.{f.name} is None in some items only")
            if all(present) and len({tuple(v.shape[1:]) for v in values}) > 1:
                shapes = [tuple(v.shape) for v in values]
                raise ValueError(f"Conditioning.cat: conditioning.{f.name} shapes differ beyond the batch: {shapes}")
            merged[f.name] = torch.cat(values) if all(present) else None
        return cls(**merged)


@dataclass
class Trajectory:
    """B sampled trajectories of T steps each; sample i is row i of every field."""

    latents: torch.Tensor
    """(B, T, *shape) float32: x_t, the input of step t."""
    next_latents: torch.Tensor
    """(B, T, *shape) float32: x_{t+1}, the output of step t (where log p is evaluated)."""
    log_probs: torch.Tensor
    """(B, T) float32: log p_old(x_{t+1} | x_t) recorded at rollout."""
    sigmas: torch.Tensor
    """(B, T+1) float32: the sigma schedule, σ_t of step t and σ_{t+1} of its output."""
    selected: torch.Tensor
    """(B, T) bool: the steps trained (S, chosen before the rollout)."""
    prompt_ids: torch.Tensor
    """(B,) long: the prompt of each sample (the advantage group)."""
    generation_ids: torch.Tensor
    """(B,) long: the index of each sample within its prompt's group."""
    conditioning: Conditioning
    """The conditioning of the B samples (text, and a conditioning image where the run has one)."""
    final_latents: torch.Tensor
    """(B, *shape) float32: x_T, the decoded result."""
    means: Optional[torch.Tensor] = None
    """(B, T, *shape) float32 SDE means μ_old of the rollout's steps (meaningful at a row's SDE steps, the ones an
    update trains), kept when an update needs them (GRPO-Guard's RatioNorm, docs/algorithms.md §9); None
    otherwise."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_samples(self) -> int:
        """Batch size B."""
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        """Number of denoising steps T."""
        return self.latents.shape[1]

    @property
    def latent_shape(self) -> torch.Size:
        """Shape of one latent, without batch and step dimensions."""
        return self.latents.shape[2:]

    def validate(self) -> None:
        """Raise ValueError naming the field whose shape or dtype breaks the documented layout."""
        if self.latents.ndim < 3:
            raise ValueError(f"latents must be (B, T, *shape), got shape {tuple(self.latents.shape)}")
        batch, steps = self.num_samples, self.num_steps
        expected = {
            "latents": (self.latents.shape, torch.float32),
            "next_latents": (self.latents.shape, torch.float32),
            "log_probs": (torch.Size((batch, steps)), torch.float32),
            "sigmas": (torch.Size((batch, steps + 1)), torch.float32),
            "selected": (torch.Size((batch, steps)), torch.bool),
            "prompt_ids": (torch.Size((batch,)), torch.long),
            "generation_ids": (torch.Size((batch,)), torch.long),
            "final_latents": (torch.Size((batch, *self.latent_shape)), torch.float32),
        }
        if self.means is not None:
            expected["means"] = (self.latents.shape, torch.float32)
        for name, (shape, dtype) in expected.items():
            value = getattr(self, name)
            if value.shape != shape:
                raise ValueError(f"trajectory.{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
            if value.dtype != dtype:
                raise ValueError(f"trajectory.{name} must be {dtype}, got {value.dtype}")
        if self.conditioning.num_samples != batch:
            raise ValueError(f"conditioning has {self.conditioning.num_samples} samples, trajectory has {batch}")

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "conditioning" and getattr(self, f.name) is not None]

    def select(self, indices: Indices) -> Trajectory:
        """The trajectories at ``indices`` (in that order), conditioning included."""
        index = _index_tensor(indices, self.num_samples)
        taken = {name: _take(getattr(self, name), index) for name in self._tensor_fields()}
        return Trajectory(conditioning=self.conditioning.select(index), **taken)

    def split(self, sizes: Sequence[int]) -> list[Trajectory]:
        """Consecutive pieces of ``sizes[k]`` samples each; the sizes must sum to B."""
        sizes = [int(size) for size in sizes]
        if any(size < 0 for size in sizes) or sum(sizes) != self.num_samples:
            raise ValueError(f"split sizes {sizes} must be non-negative and sum to {self.num_samples}")
        pieces, start = [], 0
        for size in sizes:
            pieces.append(self.select(range(start, start + size)))
            start += size
        return pieces

    @classmethod
    def cat(cls, trajectories: Sequence[Trajectory]) -> Trajectory:
        """Concatenate along the batch; all must share T and the latent shape."""
        if not trajectories:
            raise ValueError("Trajectory.cat needs at least one trajectory")
        first = trajectories[0]
        if len({t.means is None for t in trajectories}) > 1:
            raise ValueError("Trajectory.cat: some trajectories keep their SDE means and some do not")
        for other in trajectories[1:]:
            if other.num_steps != first.num_steps or other.latent_shape != first.latent_shape:
                raise ValueError(
                    f"Trajectory.cat: (T={other.num_steps}, shape={tuple(other.latent_shape)}) does not match "
                    f"(T={first.num_steps}, shape={tuple(first.latent_shape)})"
                )
        merged = {name: torch.cat([getattr(t, name) for t in trajectories]) for name in first._tensor_fields()}
        conditioning = Conditioning.cat([t.conditioning for t in trajectories])
        return cls(conditioning=conditioning, **merged)

    def selected_steps(self, i: int) -> list[int]:
        """The trained step indices of sample ``i``, ascending."""
        if not 0 <= i < self.num_samples:
            raise ValueError(f"sample index {i} out of range [0, {self.num_samples})")
        return self.selected[i].nonzero().flatten().tolist()

    def to(self, device: torch.device | str) -> Trajectory:
        """A copy with every tensor on ``device``."""
        moved = {name: getattr(self, name).to(device) for name in self._tensor_fields()}
        return replace(self, conditioning=self.conditioning.to(device), **moved)
