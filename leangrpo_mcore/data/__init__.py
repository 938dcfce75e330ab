"""Data: prompts and their sampler, text conditioning, latent decoding and the image pipeline.

Heavy dependencies load lazily: transformers only for the ``diffusers`` text encoders, diffusers only when a VAE
is built, NVIDIA DALI only for the ``dali`` image backend.
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
from .images import (
    BACKENDS,
    CLIP_MEAN,
    CLIP_STD,
    DALIImagePipeline,
    ImageTransform,
    PILImagePipeline,
    build_image_pipeline,
    dali_available,
    iter_image_batches,
    preprocess_tensor,
    resolve_image_backend,
)
from .prompts import PromptDataset, PromptRecord, PromptSampler
from .vae import DecodedImages, LatentDecoder, build_vae, latent_shape, pack_latents, unpack_latents

__all__ = [
    "BACKENDS",
    "CLIP_MEAN",
    "CLIP_STD",
    "DALIImagePipeline",
    "DecodedImages",
    "FAMILIES",
    "HashedTextEncoder",
    "ImageTransform",
    "LatentDecoder",
    "PILImagePipeline",
    "PROVIDERS",
    "PrecomputedTextEncoder",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "TextDims",
    "TextEncoder",
    "build_image_pipeline",
    "build_text_encoder",
    "build_vae",
    "dali_available",
    "iter_image_batches",
    "latent_shape",
    "pack_latents",
    "preprocess_tensor",
    "prompt_key",
    "resolve_image_backend",
    "unpack_latents",
    "write_embedding_cache",
]
