"""The text-conditioning interface every provider implements: :class:`TextEncoder` and the :class:`TextDims`
of the policy it feeds (prompts -> :class:`~leangrpo_mcore.diffusion.trajectory.Conditioning`).

The providers (:mod:`.conditioning`'s hashed embedder, :mod:`.diffusers_text`, :mod:`.embedding_cache`) build on
it, and :func:`leangrpo_mcore.data.conditioning.build_text_encoder` picks one by name.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch

from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.errors import UserError

FAMILIES = ("flux", "sd3", "wan", "qwen_image")
POOLED_FAMILIES = ("flux", "sd3")
"""Families whose policy also reads a pooled text embedding (CLIP)."""
MASKED_FAMILIES = ("qwen_image",)
"""Families whose policy reads a text attention mask: the prompts' padding is trimmed to the longest prompt of a
batch and masked (QwenImagePipeline.encode_prompt); the others read a fixed number of tokens."""
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
    """D of encoder_hidden_states (FLUX, SD3 and Qwen-Image joint_attention_dim, Wan text_dim)."""
    pooled_dim: Optional[int] = None
    """P of pooled_projections (FLUX and SD3 pooled_projection_dim); None for Wan."""
    max_length: int = T5_MAX_LENGTH
    """L, the token count of encoder_hidden_states (SD3: CLIP's 77 tokens followed by T5's L - 77; a masked family:
    the most kept, trimmed to the longest prompt by :meth:`TextEncoder.encode`)."""

    def __post_init__(self) -> None:
        if self.text_dim < 1 or self.max_length < 1 or (self.pooled_dim is not None and self.pooled_dim < 1):
            raise ValueError(f"text dims must be positive, got {self}")

    @classmethod
    def for_policy(
        cls, family: str, diffusers_config: Mapping[str, Any], *, max_length: int = T5_MAX_LENGTH
    ) -> TextDims:
        """Read the dims from a policy's diffusers-style config (FLUX, SD3: joint_attention_dim and
        pooled_projection_dim; Wan: text_dim; Qwen-Image: joint_attention_dim)."""
        key = {"flux": "joint_attention_dim", "sd3": "joint_attention_dim", "wan": "text_dim",
               "qwen_image": "joint_attention_dim"}[check_family(family)]
        if key not in diffusers_config:
            raise UserError(f"{family} policy config lacks {key!r}, needed for its text conditioning")
        pooled = diffusers_config.get("pooled_projection_dim") if family in POOLED_FAMILIES else None
        if family in POOLED_FAMILIES and pooled is None:
            raise UserError(f"{family} policy config lacks 'pooled_projection_dim', needed for its text conditioning")
        return cls(int(diffusers_config[key]), None if pooled is None else int(pooled), max_length)


class TextEmbeddings(NamedTuple):
    """What :meth:`TextEncoder.embed` returns for B prompts (float32 unless noted)."""

    tokens: torch.Tensor
    """(B, L, D) token states, L = ``dims.max_length`` (padding rows zero)."""
    pooled: Optional[torch.Tensor] = None
    """(B, P) pooled embedding (FLUX, SD3), or None."""
    mask: Optional[torch.Tensor] = None
    """(B, L) bool, True for real tokens (:data:`MASKED_FAMILIES`), or None."""


def trim_padding(tokens: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``tokens`` (B, L, D) and ``mask`` (B, L) cut or zero-padded to ``length`` tokens; the mask is None when every
    kept token is real (as QwenImagePipeline.encode_prompt drops an all-ones mask)."""
    if length <= tokens.shape[1]:
        tokens, mask = tokens[:, :length], mask[:, :length]
    else:
        extra = length - tokens.shape[1]
        tokens = torch.nn.functional.pad(tokens, (0, 0, 0, extra))
        mask = torch.nn.functional.pad(mask, (0, extra), value=False)
    return tokens, None if bool(mask.all()) else mask


def real_length(mask: torch.Tensor) -> int:
    """One past the last real token of any row of ``mask`` (B, L) (at least 1)."""
    columns = mask.any(dim=0).nonzero()
    return int(columns[-1]) + 1 if columns.numel() else 1


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
        self._negative: Optional[tuple[str, TextEmbeddings]] = None

    @abstractmethod
    def embed(self, prompts: list[str]) -> TextEmbeddings:
        """Tokens (B, L, D), pooled (B, P) or None and the mask (B, L) or None, for distinct ``prompts``."""

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """The conditioning of ``prompts`` (a list of B strings): float32 tensors on the provider's device.

        A masked family's tokens (and its negative prompt's) are trimmed to the longest real prompt of the call,
        so that the batch attends to no more padding than diffusers' pipeline pads.
        """
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode needs a non-empty list of prompt strings")
        position = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        tokens, pooled, mask = self.embed(list(position))
        index = torch.tensor([position[p] for p in prompts], dtype=torch.long, device=tokens.device)
        tokens = tokens.index_select(0, index).float()
        self._check_shapes(tokens, pooled, mask)
        batch = len(prompts)
        guidance = None if self.guidance is None else torch.full((batch,), float(self.guidance), device=tokens.device)
        negative = None if self.negative_prompt is None else self.negative_embedding(batch)
        if mask is not None:
            tokens, mask, negative = self._trimmed(tokens, mask.index_select(0, index), negative)
        return Conditioning(
            encoder_hidden_states=tokens,
            pooled_projections=None if pooled is None else pooled.index_select(0, index).float(),
            negative_encoder_hidden_states=None if negative is None else negative.tokens,
            guidance=guidance,
            # Wan's CFG reads the negative tokens only; SD3's reads the negative pooled vector too.
            negative_pooled_projections=negative.pooled if negative is not None and self.family == "sd3" else None,
            encoder_attention_mask=mask,
            negative_encoder_attention_mask=None if negative is None else negative.mask,
        )

    @staticmethod
    def _trimmed(tokens: torch.Tensor, mask: torch.Tensor, negative: Optional[TextEmbeddings]):
        """Tokens and mask cut to the longest real prompt, the negative prompt's to the same length (one length for
        both branches, so that classifier-free guidance batches them)."""
        length = max(real_length(mask), 1 if negative is None else real_length(negative.mask))
        tokens, mask = trim_padding(tokens, mask, length)
        if negative is not None:
            negative_tokens, negative_mask = trim_padding(negative.tokens, negative.mask, length)
            negative = TextEmbeddings(negative_tokens, negative.pooled, negative_mask)
        return tokens, mask, negative

    def add_negative(self, conditioning: Conditioning, prompt: str) -> Conditioning:
        """``conditioning`` with the embedding of the negative prompt ``prompt`` for classifier-free guidance (both
        branches of a masked family brought to one length), on the conditioning's device."""
        device = conditioning.encoder_hidden_states.device
        negative = self.negative_embedding(conditioning.num_samples, prompt)
        negative = TextEmbeddings(*(None if t is None else t.to(device) for t in negative))
        tokens, mask = conditioning.encoder_hidden_states, conditioning.encoder_attention_mask
        if negative.mask is not None:
            mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=device) if mask is None else mask
            tokens, mask, negative = self._trimmed(tokens, mask, negative)
        return dataclasses.replace(
            conditioning, encoder_hidden_states=tokens, encoder_attention_mask=mask,
            negative_encoder_hidden_states=negative.tokens, negative_encoder_attention_mask=negative.mask,
            negative_pooled_projections=negative.pooled if self.family == "sd3" else None)

    def negative_embedding(self, batch: int, prompt: Optional[str] = None) -> TextEmbeddings:
        """Tokens (batch, L, D), pooled (batch, P) or None and mask (batch, L) or None of a negative prompt (default:
        the configured one), float32, untrimmed; the last one embedded is cached."""
        prompt = self.negative_prompt if prompt is None else prompt
        if prompt is None:
            raise ValueError("no negative prompt configured")
        if self._negative is None or self._negative[0] != prompt:
            tokens, pooled, mask = self.embed([prompt])
            self._negative = (prompt, TextEmbeddings(tokens.float(), None if pooled is None else pooled.float(), mask))
        tokens, pooled, mask = self._negative[1]
        return TextEmbeddings(tokens.expand(batch, -1, -1).clone(),
                              None if pooled is None else pooled.expand(batch, -1).clone(),
                              None if mask is None else mask.expand(batch, -1).clone())

    __call__ = encode

    def _check_shapes(self, tokens: torch.Tensor, pooled: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> None:
        expected = (self.dims.max_length, self.dims.text_dim)
        if tuple(tokens.shape[1:]) != expected:
            got = tuple(tokens.shape[1:])
            raise UserError(f"text encoder produced tokens of shape {got}, policy needs {expected}")
        if (mask is not None) != (self.family in MASKED_FAMILIES):
            raise UserError(f"a {self.family} text encoder {'must' if mask is None else 'cannot'} produce a token mask")
        if self.family in POOLED_FAMILIES and (pooled is None or pooled.shape[1] != self.dims.pooled_dim):
            got = None if pooled is None else pooled.shape[1]
            raise UserError(f"text encoder produced pooled width {got}, policy needs {self.dims.pooled_dim}")
