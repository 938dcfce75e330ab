"""The text-conditioning interface every provider implements: :class:`TextEncoder` and the :class:`TextDims`
of the policy it feeds (prompts -> :class:`~leangrpo_mcore.diffusion.trajectory.Conditioning`).

The providers (:mod:`.conditioning`'s hashed embedder, :mod:`.diffusers_text`, :mod:`.embedding_cache`) build on
it, and :func:`leangrpo_mcore.data.conditioning.build_text_encoder` picks one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.errors import UserError

FAMILIES = ("flux", "sd3", "wan")
POOLED_FAMILIES = ("flux", "sd3")
"""Families whose policy also reads a pooled text embedding (CLIP)."""
# T5 (FLUX) and UMT5 (Wan) token budgets of the released pipelines; CLIP's is fixed at 77.
T5_MAX_LENGTH = 512


def check_family(family: str) -> str:
    """Return ``family`` if it is a known policy family, else raise ValueError listing the valid ones."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(FAMILIES)}")
    return family


@dataclass(frozen=True)
class TextDims:
    """The text-embedding shapes a policy consumes."""

    text_dim: int
    """D of encoder_hidden_states (FLUX and SD3 joint_attention_dim, Wan text_dim)."""
    pooled_dim: Optional[int] = None
    """P of pooled_projections (FLUX and SD3 pooled_projection_dim); None for Wan."""
    max_length: int = T5_MAX_LENGTH
    """L, the fixed token count of encoder_hidden_states (SD3: CLIP's 77 tokens followed by T5's L - 77)."""

    def __post_init__(self) -> None:
        if self.text_dim < 1 or self.max_length < 1 or (self.pooled_dim is not None and self.pooled_dim < 1):
            raise ValueError(f"text dims must be positive, got {self}")

    @classmethod
    def for_policy(
        cls, family: str, diffusers_config: Mapping[str, Any], *, max_length: int = T5_MAX_LENGTH
    ) -> TextDims:
        """Read the dims from a policy's diffusers-style config (FLUX, SD3: joint_attention_dim and
        pooled_projection_dim; Wan: text_dim)."""
        key = {"flux": "joint_attention_dim", "sd3": "joint_attention_dim", "wan": "text_dim"}[check_family(family)]
        if key not in diffusers_config:
            raise UserError(f"{family} policy config lacks {key!r}, needed for its text conditioning")
        pooled = diffusers_config.get("pooled_projection_dim") if family in POOLED_FAMILIES else None
        if family in POOLED_FAMILIES and pooled is None:
            raise UserError(f"{family} policy config lacks 'pooled_projection_dim', needed for its text conditioning")
        return cls(int(diffusers_config[key]), None if pooled is None else int(pooled), max_length)


class TextEncoder(ABC):
    """Prompts -> Conditioning. Subclasses implement :meth:`embed`; duplicates are embedded once per call."""

    def __init__(
        self, family: str, dims: TextDims, *, negative_prompt: Optional[str] = None, guidance: Optional[float] = None
    ) -> None:
        """``negative_prompt`` (e.g. "" for Wan's CFG) adds negative tokens; ``guidance`` fills the (B,) field."""
        self.family = check_family(family)
        self.dims = dims
        if family in POOLED_FAMILIES and dims.pooled_dim is None:
            raise ValueError(f"{family} conditioning needs dims.pooled_dim (the CLIP pooled width)")
        self.negative_prompt = negative_prompt
        self.guidance = guidance
        self._negative: Optional[tuple[str, torch.Tensor, Optional[torch.Tensor]]] = None

    @abstractmethod
    def embed(self, prompts: list[str]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens (B, L, D) and pooled (B, P) or None, float32, for distinct ``prompts``."""

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """The conditioning of ``prompts`` (a list of B strings): float32 tensors on the provider's device."""
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode needs a non-empty list of prompt strings")
        position = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        tokens, pooled = self.embed(list(position))
        index = torch.tensor([position[p] for p in prompts], dtype=torch.long, device=tokens.device)
        tokens = tokens.index_select(0, index).float()
        self._check_shapes(tokens, pooled)
        batch = len(prompts)
        guidance = None if self.guidance is None else torch.full((batch,), float(self.guidance), device=tokens.device)
        negative = negative_pooled = None
        if self.negative_prompt is not None:
            negative, negative_pooled = self.negative_embedding(batch)
        return Conditioning(
            encoder_hidden_states=tokens,
            pooled_projections=None if pooled is None else pooled.index_select(0, index).float(),
            negative_encoder_hidden_states=negative,
            guidance=guidance,
            # Wan's CFG reads the negative tokens only; SD3's reads the negative pooled vector too.
            negative_pooled_projections=negative_pooled if self.family == "sd3" else None,
        )

    def negative_embedding(self, batch: int, prompt: Optional[str] = None) -> tuple[torch.Tensor,
                                                                                    Optional[torch.Tensor]]:
        """Tokens (batch, L, D) and pooled (batch, P) or None of a negative prompt (default: the configured one),
        float32; the last one embedded is cached."""
        prompt = self.negative_prompt if prompt is None else prompt
        if prompt is None:
            raise ValueError("no negative prompt configured")
        if self._negative is None or self._negative[0] != prompt:
            tokens, pooled = self.embed([prompt])
            self._negative = (prompt, tokens.float(), None if pooled is None else pooled.float())
        _, tokens, pooled = self._negative
        return tokens.expand(batch, -1, -1).clone(), None if pooled is None else pooled.expand(batch, -1).clone()

    __call__ = encode

    def _check_shapes(self, tokens: torch.Tensor, pooled: Optional[torch.Tensor]) -> None:
        expected = (self.dims.max_length, self.dims.text_dim)
        if tuple(tokens.shape[1:]) != expected:
            got = tuple(tokens.shape[1:])
            raise UserError(f"text encoder produced tokens of shape {got}, policy needs {expected}")
        if self.family in POOLED_FAMILIES and (pooled is None or pooled.shape[1] != self.dims.pooled_dim):
            got = None if pooled is None else pooled.shape[1]
            raise UserError(f"text encoder produced pooled width {got}, policy needs {self.dims.pooled_dim}")
