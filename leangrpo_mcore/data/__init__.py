"""Data: prompts and their sampler, text conditioning and latent decoding.

Heavy dependencies load lazily: transformers only for the ``diffusers`` text encoders, diffusers only when a VAE
is built.
"""

from .conditioning import (
    FAMILIES,
    PROVIDERS,
    HashedTextEncoder,
    TextDims,
    TextEncoder,
    build_text_encoder,
)
from .embedding_cache import PrecomputedTextEncoder, prompt_key, write_embedding_cache
from .prompts import PromptDataset, PromptRecord, PromptSampler
from .vae import DecodedImages, LatentDecoder, build_vae, latent_shape, pack_latents, unpack_latents

__all__ = [
    "DecodedImages",
    "FAMILIES",
    "HashedTextEncoder",
    "LatentDecoder",
    "PROVIDERS",
    "PrecomputedTextEncoder",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "TextDims",
    "TextEncoder",
    "build_text_encoder",
    "build_vae",
    "latent_shape",
    "pack_latents",
    "prompt_key",
    "unpack_latents",
    "write_embedding_cache",
]
