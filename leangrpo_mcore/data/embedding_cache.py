"""Text embeddings cached on disk (the ``precomputed`` provider), as DanceGRPO precomputes its T5 states.

A cache is a directory with ``index.json`` and shards ``embeddings-NNNNN.safetensors``. Each shard holds
``encoder_hidden_states`` (n, L, D), for FLUX and SD3 ``pooled_projections`` (n, P), stored in the cache dtype,
and for Qwen-Image the bool ``encoder_attention_mask`` (n, L) of the real tokens.
``index.json``::

    {"format": "leangrpo_mcore.text_embeddings", "version": 1, "family": "flux", "text_dim": D,
     "pooled_dim": P | null, "max_length": L, "dtype": "float32", "encoder": "<what produced it>",
     "entries": {"<prompt_key>": {"prompt": "...", "shard": "embeddings-00000.safetensors", "row": 0}, ...}}

``prompt_key`` is the blake2b-128 hex digest of the UTF-8 prompt. A negative prompt (Wan's CFG) is an ordinary
entry. The index is written last and atomically, so a cache with an index is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from leangrpo_mcore.data.text_encoder import MASKED_FAMILIES, TextDims, TextEmbeddings, TextEncoder
from leangrpo_mcore.errors import UserError

CACHE_FORMAT = "leangrpo_mcore.text_embeddings"
CACHE_VERSION = 1
INDEX_FILE = "index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prompt_key(prompt: str) -> str:
    """The cache key of ``prompt``: a stable hash of its exact text."""
    return hashlib.blake2b(prompt.encode("utf-8"), digest_size=16).hexdigest()


def write_embedding_cache(
    encoder: TextEncoder,
    prompts: Sequence[str],
    out_dir: str | Path,
    *,
    shard_size: int = 256,
    dtype: torch.dtype = torch.float32,
    description: str = "",
    overwrite: bool = False,
    on_shard: Optional[Callable[[int, int], None]] = None,
) -> Path:
    """Embed the distinct ``prompts`` with ``encoder`` and write a cache to ``out_dir``; returns the index path.

    ``on_shard(done, total)`` reports progress in prompts. An existing cache is only replaced with ``overwrite``.
    """
    names = {v: k for k, v in _DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"cache dtype must be one of {', '.join(_DTYPES)}, got {dtype}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    unique = list(dict.fromkeys(prompts))
    if not unique:
        raise UserError("no prompts to precompute")
    out = Path(out_dir)
    if (out / INDEX_FILE).exists() and not overwrite:
        raise UserError(f"{out} already holds an embedding cache (replace it with --overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    for shard_index, start in enumerate(range(0, len(unique), shard_size)):
        chunk = unique[start:start + shard_size]
        tokens, pooled, mask = encoder.embed(chunk)
        tensors = {"encoder_hidden_states": tokens.to(dtype).cpu().contiguous()}
        if pooled is not None:
            tensors["pooled_projections"] = pooled.to(dtype).cpu().contiguous()
        if mask is not None:
            tensors["encoder_attention_mask"] = mask.cpu().contiguous()
        shard = f"embeddings-{shard_index:05d}.safetensors"
        save_file(tensors, str(out / shard))
        entries.update({prompt_key(p): {"prompt": p, "shard": shard, "row": row} for row, p in enumerate(chunk)})
        if on_shard is not None:
            on_shard(start + len(chunk), len(unique))
    index = {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "family": encoder.family,
        "text_dim": encoder.dims.text_dim,
        "pooled_dim": encoder.dims.pooled_dim,
        "max_length": encoder.dims.max_length,
        "dtype": names[dtype],
        "encoder": description or type(encoder).__name__,
        "entries": entries,
    }
    tmp = out / f".{INDEX_FILE}.tmp"
    tmp.write_text(json.dumps(index, indent=1), encoding="utf-8")
    os.replace(tmp, out / INDEX_FILE)
    return out / INDEX_FILE


def _read_index(root: Path) -> dict[str, Any]:
    path = root / INDEX_FILE
    if not path.is_file():
        raise UserError(f"no embedding cache at {root} (missing {INDEX_FILE}; run tools/precompute_embeddings.py)")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"corrupt embedding cache index {path}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != CACHE_FORMAT or index.get("version") != CACHE_VERSION:
        raise UserError(f"{path} is not a {CACHE_FORMAT} v{CACHE_VERSION} index")
    return index


class PrecomputedTextEncoder(TextEncoder):
    """Looks prompts up in an embedding cache; a prompt that is not cached is a one-line UserError."""

    def __init__(
        self,
        path: str | Path,
        family: str,
        dims: TextDims,
        *,
        negative_prompt: Optional[str] = None,
        guidance: Optional[float] = None,
    ) -> None:
        """Open the cache at ``path`` and check that it was made for this family and these dims."""
        super().__init__(family, dims, negative_prompt=negative_prompt, guidance=guidance)
        self.root = Path(path)
        index = _read_index(self.root)
        cached = (index.get("family"), index.get("text_dim"), index.get("pooled_dim"), index.get("max_length"))
        wanted = (family, dims.text_dim, dims.pooled_dim, dims.max_length)
        if cached != wanted:
            raise UserError(
                f"embedding cache {self.root} holds (family, text_dim, pooled_dim, max_length)={cached}, "
                f"the policy needs {wanted}"
            )
        self.entries: dict[str, dict[str, Any]] = index["entries"]
        self._shards: dict[str, Any] = {}

    def _shard(self, name: str) -> Any:
        if name not in self._shards:
            path = self.root / name
            if not path.is_file():
                raise UserError(f"embedding cache shard missing: {path}")
            self._shards[name] = safe_open(str(path), framework="pt")
        return self._shards[name]

    def _entry(self, prompt: str) -> dict[str, Any]:
        entry = self.entries.get(prompt_key(prompt))
        if entry is None or entry.get("prompt") != prompt:
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            raise UserError(f"prompt not in the embedding cache {self.root}: {shown!r}")
        return entry

    def embed(self, prompts: list[str]) -> TextEmbeddings:
        """Tokens (B, L, D), for FLUX and SD3 pooled (B, P), for Qwen-Image the mask (B, L), read from the cache
        (float32 tokens)."""
        tokens, pooled, masks = [], [], []
        for prompt in prompts:
            entry = self._entry(prompt)
            shard, row = self._shard(entry["shard"]), int(entry["row"])
            tokens.append(shard.get_slice("encoder_hidden_states")[row:row + 1].float())
            if self.dims.pooled_dim is not None:
                pooled.append(shard.get_slice("pooled_projections")[row:row + 1].float())
            if self.family in MASKED_FAMILIES:
                masks.append(self._mask(shard, row))
        return TextEmbeddings(torch.cat(tokens), torch.cat(pooled) if pooled else None,
                              torch.cat(masks) if masks else None)

    def _mask(self, shard: Any, row: int) -> torch.Tensor:
        if "encoder_attention_mask" not in shard.keys():
            raise UserError(f"embedding cache {self.root} holds no encoder_attention_mask ({self.family} needs it: "
                            "rewrite it with tools/precompute_embeddings.py)")
        return shard.get_slice("encoder_attention_mask")[row:row + 1].to(torch.bool)
