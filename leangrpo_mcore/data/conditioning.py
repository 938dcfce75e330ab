"""Text conditioning: prompts -> :class:`~leangrpo_mcore.diffusion.trajectory.Conditioning`.

Three providers share one interface (:class:`TextEncoder`, in :mod:`.text_encoder`):

- ``hashed``: a tiny deterministic embedder for CPU tests and the demo. It is **not a language model**: each
  word is hashed (keyed blake2b, never Python's salted ``hash``) to a fixed random vector, so prompts get
  distinct, reproducible embeddings in every process, but no meaning.
- ``diffusers``: the pipeline's own text encoders from a local directory (:mod:`.diffusers_text`).
- ``precomputed``: embeddings cached on disk by ``tools/precompute_embeddings.py`` (:mod:`.embedding_cache`).

Every provider returns float32 tensors: ``encoder_hidden_states`` (B, L, D), ``pooled_projections`` (B, P) for
FLUX and SD3 (None for Wan and Qwen-Image), the negative-prompt tokens (B, L, D) when a negative prompt is set
(CFG), the distilled-guidance value (B,) when one is set (FLUX-dev), and for Qwen-Image the bool token masks of
the prompts padded to the longest.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Optional

import torch

from leangrpo_mcore.data.text_encoder import (  # noqa: F401 (the interface, re-exported)
    FAMILIES,
    MASKED_FAMILIES,
    T5_MAX_LENGTH,
    TextDims,
    TextEmbeddings,
    TextEncoder,
    check_family,
)
from leangrpo_mcore.errors import UserError

PROVIDERS = ("hashed", "diffusers", "precomputed")
_WORD = re.compile(r"\w+|[^\w\s]")
_END_TOKEN = "</s>"


def _word_seed(domain: str, word: str, seed: int) -> int:
    key = int(seed).to_bytes(8, "little", signed=False)
    digest = hashlib.blake2b(f"{domain}\x1f{word}".encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class HashedTextEncoder(TextEncoder):
    """A deterministic bag-of-hashed-words embedder for tests and the demo. NOT a language model.

    Tokens are the lower-cased words and punctuation of the prompt plus an end token (like T5's ``</s>``), cut
    to ``max_length`` with the end token kept; token i gets the fixed N(0, 1) vector of its word, drawn from a
    generator seeded by a keyed blake2b hash of (word, ``seed``); positions after the end token are zero (as in
    Wan's padded UMT5 output) and, for a masked family (Qwen-Image), masked. The pooled vector is the mean of
    per-word vectors from a second hash domain.
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

    def embed(self, prompts: list[str]) -> TextEmbeddings:
        """Tokens (B, L, D), for FLUX and SD3 pooled (B, P), for Qwen-Image the mask (B, L); float32."""
        tokens = torch.zeros(len(prompts), self.dims.max_length, self.dims.text_dim)
        pooled = None if self.dims.pooled_dim is None else torch.zeros(len(prompts), self.dims.pooled_dim)
        lengths = []
        for row, prompt in enumerate(prompts):
            words = self.tokenize(prompt)
            lengths.append(len(words))
            tokens[row, : len(words)] = torch.stack([self._vector("token", w, self.dims.text_dim) for w in words])
            if pooled is not None:
                pooled[row] = torch.stack([self._vector("pooled", w, self.dims.pooled_dim) for w in words]).mean(0)
        mask = None
        if self.family in MASKED_FAMILIES:
            mask = torch.arange(self.dims.max_length)[None, :] < torch.tensor(lengths)[:, None]
        return TextEmbeddings(tokens, pooled, mask)


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
