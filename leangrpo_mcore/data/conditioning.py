"""Text conditioning: prompts -> :class:`~leangrpo_mcore.diffusion.trajectory.Conditioning`.

Three providers share one interface (:class:`TextEncoder`):

- ``hashed``: a tiny deterministic embedder for CPU tests and the demo. It is **not a language model**: each
  word is hashed (keyed blake2b, never Python's salted ``hash``) to a fixed random vector, so prompts get
  distinct, reproducible embeddings in every process, but no meaning.
- ``diffusers``: the pipeline's own text encoders from a local directory (:mod:`.diffusers_text`).
- ``precomputed``: embeddings cached on disk by ``tools/precompute_embeddings.py`` (:mod:`.embedding_cache`).

Every provider returns float32 tensors: ``encoder_hidden_states`` (B, L, D), ``pooled_projections`` (B, P) for
FLUX (None for Wan), the negative-prompt tokens (B, L, D) when a negative prompt is set (Wan's CFG), and the
distilled-guidance value (B,) when one is set (FLUX-dev).
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.errors import UserError

FAMILIES = ("flux", "wan")
PROVIDERS = ("hashed", "diffusers", "precomputed")
# T5 (FLUX) and UMT5 (Wan) token budgets of the released pipelines; CLIP's is fixed at 77.
T5_MAX_LENGTH = 512
_WORD = re.compile(r"\w+|[^\w\s]")
_END_TOKEN = "</s>"


def check_family(family: str) -> str:
    """Return ``family`` if it is a known policy family, else raise ValueError listing the valid ones."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(FAMILIES)}")
    return family


@dataclass(frozen=True)
class TextDims:
    """The text-embedding shapes a policy consumes."""

    text_dim: int
    """D of encoder_hidden_states (FLUX joint_attention_dim, Wan text_dim)."""
    pooled_dim: Optional[int] = None
    """P of pooled_projections (FLUX pooled_projection_dim); None for Wan."""
    max_length: int = T5_MAX_LENGTH
    """L, the fixed token count of encoder_hidden_states."""

    def __post_init__(self) -> None:
        if self.text_dim < 1 or self.max_length < 1 or (self.pooled_dim is not None and self.pooled_dim < 1):
            raise ValueError(f"text dims must be positive, got {self}")

    @classmethod
    def for_policy(
        cls, family: str, diffusers_config: Mapping[str, Any], *, max_length: int = T5_MAX_LENGTH
    ) -> TextDims:
        """Read the dims from a policy's diffusers-style config (FLUX: joint_attention_dim and
        pooled_projection_dim; Wan: text_dim)."""
        key = {"flux": "joint_attention_dim", "wan": "text_dim"}[check_family(family)]
        if key not in diffusers_config:
            raise UserError(f"{family} policy config lacks {key!r}, needed for its text conditioning")
        pooled = diffusers_config.get("pooled_projection_dim") if family == "flux" else None
        if family == "flux" and pooled is None:
            raise UserError("flux policy config lacks 'pooled_projection_dim', needed for its text conditioning")
        return cls(int(diffusers_config[key]), None if pooled is None else int(pooled), max_length)


class TextEncoder(ABC):
    """Prompts -> Conditioning. Subclasses implement :meth:`embed`; duplicates are embedded once per call."""

    def __init__(
        self, family: str, dims: TextDims, *, negative_prompt: Optional[str] = None, guidance: Optional[float] = None
    ) -> None:
        """``negative_prompt`` (e.g. "" for Wan's CFG) adds negative tokens; ``guidance`` fills the (B,) field."""
        self.family = check_family(family)
        self.dims = dims
        if family == "flux" and dims.pooled_dim is None:
            raise ValueError("flux conditioning needs dims.pooled_dim (the CLIP pooled width)")
        self.negative_prompt = negative_prompt
        self.guidance = guidance
        self._negative: Optional[torch.Tensor] = None

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
        negative = None
        if self.negative_prompt is not None:
            if self._negative is None:
                self._negative = self.embed([self.negative_prompt])[0].float()
            negative = self._negative.expand(batch, -1, -1).clone()
        return Conditioning(
            encoder_hidden_states=tokens,
            pooled_projections=None if pooled is None else pooled.index_select(0, index).float(),
            negative_encoder_hidden_states=negative,
            guidance=guidance,
        )

    __call__ = encode

    def _check_shapes(self, tokens: torch.Tensor, pooled: Optional[torch.Tensor]) -> None:
        expected = (self.dims.max_length, self.dims.text_dim)
        if tuple(tokens.shape[1:]) != expected:
            got = tuple(tokens.shape[1:])
            raise UserError(f"text encoder produced tokens of shape {got}, policy needs {expected}")
        if self.family == "flux" and (pooled is None or pooled.shape[1] != self.dims.pooled_dim):
            got = None if pooled is None else pooled.shape[1]
            raise UserError(f"text encoder produced pooled width {got}, policy needs {self.dims.pooled_dim}")


def _word_seed(domain: str, word: str, seed: int) -> int:
    key = int(seed).to_bytes(8, "little", signed=False)
    digest = hashlib.blake2b(f"{domain}\x1f{word}".encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class HashedTextEncoder(TextEncoder):
    """A deterministic bag-of-hashed-words embedder for tests and the demo. NOT a language model.

    Tokens are the lower-cased words and punctuation of the prompt plus an end token (like T5's ``</s>``), cut
    to ``max_length`` with the end token kept; token i gets the fixed N(0, 1) vector of its word, drawn from a
    generator seeded by a keyed blake2b hash of (word, ``seed``); positions after the end token are zero (as in
    Wan's padded UMT5 output). The pooled vector is the mean of per-word vectors from a second hash domain.
    """

    def __init__(
        self,
        family: str,
        dims: TextDims,
        *,
        seed: int = 0,
        negative_prompt: Optional[str] = None,
        guidance: Optional[float] = None,
    ) -> None:
        """``seed`` selects the vector table; the same seed gives the same embeddings in every process."""
        super().__init__(family, dims, negative_prompt=negative_prompt, guidance=guidance)
        if seed < 0:
            raise ValueError(f"hashed text encoder seed must be >= 0, got {seed}")
        self.seed = seed
        self._vectors: dict[tuple[str, str], torch.Tensor] = {}

    def tokenize(self, prompt: str) -> list[str]:
        """The prompt's tokens, end token included, at most ``max_length``."""
        words = _WORD.findall(prompt.lower())[: self.dims.max_length - 1]
        return words + [_END_TOKEN]

    def _vector(self, domain: str, word: str, dim: int) -> torch.Tensor:
        cached = self._vectors.get((domain, word))
        if cached is None:
            generator = torch.Generator().manual_seed(_word_seed(domain, word, self.seed))
            cached = torch.randn(dim, generator=generator, dtype=torch.float32)
            self._vectors[(domain, word)] = cached
        return cached

    def embed(self, prompts: list[str]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens (B, L, D) and, for FLUX, pooled (B, P); float32."""
        tokens = torch.zeros(len(prompts), self.dims.max_length, self.dims.text_dim)
        pooled = None if self.dims.pooled_dim is None else torch.zeros(len(prompts), self.dims.pooled_dim)
        for row, prompt in enumerate(prompts):
            words = self.tokenize(prompt)
            tokens[row, : len(words)] = torch.stack([self._vector("token", w, self.dims.text_dim) for w in words])
            if pooled is not None:
                pooled[row] = torch.stack([self._vector("pooled", w, self.dims.pooled_dim) for w in words]).mean(0)
        return tokens, pooled


def build_text_encoder(
    model_config: Any,
    family: str,
    policy_dims: TextDims,
    *,
    negative_prompt: Optional[str] = None,
    guidance: Optional[float] = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TextEncoder:
    """The provider named by ``model_config.text_encoder`` (hashed | diffusers | precomputed).

    ``model_config.text_encoder_path`` is the diffusers pipeline directory or the embedding cache;
    ``seed`` selects the hashed table; ``device``/``dtype`` place the diffusers encoders (outputs stay float32).
    """
    name = getattr(model_config, "text_encoder", None)
    path = getattr(model_config, "text_encoder_path", None)
    common = {"negative_prompt": negative_prompt, "guidance": guidance}
    if name == "hashed":
        return HashedTextEncoder(family, policy_dims, seed=seed, **common)
    if name not in ("diffusers", "precomputed"):
        raise ValueError(f"unknown text encoder {name!r}; valid: {', '.join(PROVIDERS)}")
    if not path:
        raise UserError(f"model.text_encoder={name} needs model.text_encoder_path")
    if name == "diffusers":
        from leangrpo_mcore.data.diffusers_text import DiffusersTextEncoder

        return DiffusersTextEncoder(path, family, policy_dims, device=device, dtype=dtype, **common)
    from leangrpo_mcore.data.embedding_cache import PrecomputedTextEncoder

    return PrecomputedTextEncoder(path, family, policy_dims, **common)
