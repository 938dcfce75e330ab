"""Architecture arithmetic for the layout planner: parameters, tokens and FLOPs from diffusers hyper-parameters.

Pure Python. An :class:`ArchSpec` lists every linear layer of a FLUX, SD3, Wan or Qwen-Image transformer (diffusers
module names,
shapes, which token stream it runs over and how tensor parallelism splits it) plus the non-linear parameters
(norm weights, scale-shift tables). Parameter counts, forward FLOPs, LoRA adapter sizes and TP all-reduce volumes
all follow from that one list, so they cannot disagree with each other.

Token streams: ``image`` (image / video tokens), ``text`` (text-encoder tokens), ``joint`` (both, FLUX's joint
sequence; SD3's and Qwen-Image's joint attention), ``sample`` (one row per sample: timestep / pooled-text embeddings
and adaLN modulation) and ``clip`` (a conditioning image's CLIP tokens: Wan2.1-I2V). An image-conditioned FLUX
(FLUX.1-Kontext) appends the reference image's tokens to the generated ones: they are ``image`` tokens to every
layer, counted apart as ``reference`` (what the trajectories store is the generated latent only); Wan2.2-TI2V's
image takes the place of the first latent frame, whose tokens are then its ``reference``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Optional

from leangrpo_mcore.block_split import stage_block_counts
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.vae_factors import (FLUX_SPATIAL_FACTOR, QWEN_IMAGE_SPATIAL_FACTOR, SD3_SPATIAL_FACTOR,
                                        spatial_factor)

FLUX_CLASS = "FluxTransformer2DModel"
SD3_CLASS = "SD3Transformer2DModel"
WAN_CLASS = "WanTransformer3DModel"
QWEN_IMAGE_CLASS = "QwenImageTransformer2DModel"
_CLASS_FAMILIES = {FLUX_CLASS: "flux", SD3_CLASS: "sd3", WAN_CLASS: "wan", QWEN_IMAGE_CLASS: "qwen_image"}
_IMAGE_FAMILIES = ("flux", "sd3", "qwen_image")
"""Families of image models, whose stage boundary is ``[temb, text, image]`` rows."""

_FLUX_DEV = {
    "_class_name": FLUX_CLASS, "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19,
    "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
}
# Published diffusers configs (config.json of the transformer subfolder) of the built-in model names.
BUILTIN_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "flux-dev": ("flux", dict(_FLUX_DEV)),
    "flux-kontext-dev": ("flux", dict(_FLUX_DEV)),  # FLUX.1-Kontext-dev: FLUX.1-dev's transformer layout
    "wan2.1-1.3b": ("wan", {
        "_class_name": WAN_CLASS, "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128,
        "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960,
        "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
    }),
    "wan2.1-14b": ("wan", {
        "_class_name": WAN_CLASS, "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
        "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824,
        "num_layers": 40, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
    }),
    # two experts of Wan2.1-14B's shape; the high-noise one runs the steps with t >= 875 (model_index.json)
    "wan2.2-t2v-a14b": ("wan", {
        "_class_name": WAN_CLASS, "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
        "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824,
        "num_layers": 40, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
        "boundary_ratio": 0.875,
    }),
    # image-to-video: mask and image latents concatenated to the noisy latents (36 = 16 + 4 + 16 channels in)
    "wan2.1-i2v-14b": ("wan", {
        "_class_name": WAN_CLASS, "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
        "in_channels": 36, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824,
        "num_layers": 40, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
        "image_dim": 1280, "added_kv_proj_dim": 5120,
    }),
    "wan2.2-i2v-a14b": ("wan", {
        "_class_name": WAN_CLASS, "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
        "in_channels": 36, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824,
        "num_layers": 40, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
        "boundary_ratio": 0.9,
    }),
    "wan2.2-ti2v-5b": ("wan", {
        "_class_name": WAN_CLASS, "patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128,
        "in_channels": 48, "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 14336,
        "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
        "vae_scale_factor_temporal": 4, "vae_scale_factor_spatial": 16,
    }),
    "sd3.5-medium": ("sd3", {
        "_class_name": SD3_CLASS, "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
        "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
        "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "out_channels": 16,
        "pos_embed_max_size": 384, "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm",
    }),
    "sd3.5-large": ("sd3", {
        "_class_name": SD3_CLASS, "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38,
        "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
        "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "out_channels": 16,
        "pos_embed_max_size": 192, "dual_attention_layers": [], "qk_norm": "rms_norm",
    }),
    "qwen-image": ("qwen_image", {
        "_class_name": QWEN_IMAGE_CLASS, "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
        "axes_dims_rope": [16, 56, 56],
    }),
}

# The families' default LoRA targets (``FAMILY.lora_targets`` of the models package; FlowGRPO's FLUX set).
DEFAULT_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "flux": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
             "attn.add_v_proj", "attn.to_add_out", "ff", "ff_context"),
    "sd3": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
            "attn.add_v_proj", "attn.to_add_out"),
    "wan": ("to_q", "to_k", "to_v", "to_out"),
    "qwen_image": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                   "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                   "txt_mlp.net.2"),
}

IMAGE_CONDITIONED = frozenset({"flux-kontext-dev"})
"""Built-in models planned with a conditioning image by default (``leangrpo-plan --model``)."""

STREAMS = ("image", "text", "joint", "sample", "clip")
CLIP_TOKENS = 257
"""CLIP ViT-H/14 tokens of a 224-pixel image (16 x 16 patches and the class token): Wan2.1-I2V's image tokens."""
TP_MODES = ("column", "row", "replicated")


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer: module name (as in the policy), shape, the tokens it runs over and its TP split."""

    name: str
    in_features: int
    out_features: int
    stream: str
    tp: str = "replicated"
    bias: bool = True

    def __post_init__(self) -> None:
        if self.stream not in STREAMS or self.tp not in TP_MODES:
            raise UserError(f"linear {self.name}: stream {self.stream!r} / tp {self.tp!r} not in "
                            f"{STREAMS} / {TP_MODES}")

    @property
    def params(self) -> int:
        """Weight plus bias elements."""
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class BlockSpec:
    """A kind of transformer block and how many of it the model stacks."""

    kind: str
    count: int
    linears: tuple[LinearSpec, ...]
    norm_params: int
    """Non-linear parameters per block that TP replicates (per-head norms, scale-shift tables, affine norms)."""
    tp_norm_params: int
    """Non-linear parameters per block that TP shards (Wan's q/k RMSNorm across all heads)."""
    attention: tuple[tuple[str, str], ...]
    """(query stream, key/value stream) of each attention in the block."""
    mlp_dim: int
    """Hidden width of the block's MLP (for the activation model)."""
    stream: str
    """The token stream of the block's residual (joint for FLUX, image for Wan)."""
    idle: tuple[LinearSpec, ...] = ()
    """Linears the block holds but never runs, their output unread (Qwen-Image's last text MLP): parameters,
    gradients-free, no FLOPs, no activations."""

    @property
    def held(self) -> tuple[LinearSpec, ...]:
        """Every linear whose parameters the block holds: the ones it runs and the idle ones."""
        return self.linears + self.idle


@dataclass(frozen=True)
class ArchSpec:
    """A FLUX or Wan transformer as the planner sees it."""

    family: str
    name: str
    config: dict
    hidden_size: int
    num_heads: int
    head_dim: int
    latent_channels: int
    spatial_stride: int
    """Pixels per token side (FLUX 16: VAE 8 x 2x2 packing; Wan VAE stride x patch)."""
    temporal_stride: int
    """Pixel frames per latent frame (Wan's VAE: 4; images: 1)."""
    temporal_patch: int
    vae_stride: int
    """Pixels per latent pixel of the paired VAE."""
    root: tuple[LinearSpec, ...]
    root_norm_params: int
    blocks: tuple[BlockSpec, ...]
    experts: int = 1
    """Transformers of this architecture the policy holds (Wan2.2-A14B: 2, a step runs one of them); the counts
    below (parameters, FLOPs) are one expert's."""
    image_tokens: int = 0
    """CLIP tokens of the conditioning image every forward reads (Wan2.1-I2V: 257), the ``clip`` stream."""

    @property
    def num_layers(self) -> int:
        """Transformer blocks of every kind."""
        return sum(b.count for b in self.blocks)

    def tokens(self, height: int, width: int, frames: int = 1, text_tokens: int = 512, *,
               reference: bool = False) -> dict[str, int]:
        """Tokens per sample of each stream (``image``, ``text``, ``joint``, ``sample``; ``clip`` for Wan2.1-I2V's
        CLIP tokens) at a resolution, and with ``reference`` also ``reference``: the conditioning image's tokens
        among the image ones (FLUX.1-Kontext's reference image at the generated image's size, Wan2.2-TI2V's first
        latent frame; none for a channel-concatenated Wan checkpoint, whose image enters through its channels)."""
        if height <= 0 or width <= 0 or frames <= 0 or text_tokens < 0:
            raise UserError(f"resolution {height}x{width}x{frames} and text tokens {text_tokens} must be positive")
        s = self.spatial_stride
        if height % s or width % s:
            raise UserError(f"{self.name}: height and width must be multiples of {s}, got {height}x{width}")
        if self.family in _IMAGE_FAMILIES and frames != 1:
            raise UserError(f"{self.name} is an image model: frames must be 1, got {frames}")
        if (frames - 1) % self.temporal_stride:
            raise UserError(f"{self.name}: frames must be 1 + a multiple of {self.temporal_stride}, got {frames}")
        latent_frames = (frames - 1) // self.temporal_stride + 1
        if latent_frames % self.temporal_patch:
            raise UserError(f"{self.name}: {latent_frames} latent frames do not split into patches of "
                            f"{self.temporal_patch}")
        image = (latent_frames // self.temporal_patch) * (height // s) * (width // s)
        if reference and self.family in ("sd3", "qwen_image"):
            raise UserError(f"{self.name}: the planner counts no conditioning image for {self.family}: it takes none")
        tokens = {"image": image, "text": text_tokens, "joint": image + text_tokens, "sample": 1}
        if self.image_tokens:  # Wan2.1-I2V's CLIP tokens, read by every block's cross-attention
            tokens["clip"] = self.image_tokens
        if reference and self.family == "flux":  # the source's tokens, as many as the generated image's, are image
            tokens.update(image=2 * image, joint=2 * image + text_tokens, reference=image)  # tokens to every layer
        elif reference and int(self.config["in_channels"]) == self.latent_channels:
            # Wan2.2-TI2V: the image is the first latent frame (a channel-concatenated checkpoint reads its image
            # through its channels and keeps every frame to generate)
            tokens["reference"] = image // (latent_frames // self.temporal_patch)
        return tokens

    def _patch_elements(self) -> int:
        return self.temporal_patch * (self.spatial_stride // self.vae_stride) ** 2 * self.latent_channels

    def latent_elements(self, tokens: dict[str, int]) -> int:
        """Elements of one sample's generated latent (what a trajectory stores per step)."""
        return (tokens["image"] - tokens.get("reference", 0)) * self._patch_elements()

    def reference_elements(self, tokens: dict[str, int]) -> int:
        """Elements of one sample's encoded conditioning image (its trajectory's conditioning keeps one)."""
        return tokens.get("reference", 0) * self._patch_elements()


def _linear_params(linears: tuple[LinearSpec, ...], part: Optional[str] = None) -> int:
    """All linear parameters, or only the TP-``sharded`` / ``replicated`` part of them.

    Column-parallel layers shard weight and bias; row-parallel ones shard the weight and add a full bias once.
    """
    total = 0
    for lin in linears:
        sharded = {"column": lin.params, "row": lin.in_features * lin.out_features}.get(lin.tp, 0)
        total += {None: lin.params, "sharded": sharded, "replicated": lin.params - sharded}[part]
    return total


def param_counts(arch: ArchSpec) -> dict[str, int]:
    """Parameters: ``total``, ``tp_sharded`` (split by TP) and ``replicated`` (full copy on every TP rank)."""
    sharded = _linear_params(arch.root, "sharded")
    sharded += sum(b.count * (_linear_params(b.held, "sharded") + b.tp_norm_params) for b in arch.blocks)
    replicated = _linear_params(arch.root, "replicated") + arch.root_norm_params
    replicated += sum(b.count * (_linear_params(b.held, "replicated") + b.norm_params) for b in arch.blocks)
    return {"total": sharded + replicated, "tp_sharded": sharded, "replicated": replicated}


def params_per_rank(arch: ArchSpec, tp: int) -> int:
    """Parameters a TP rank holds before FSDP sharding (its slice of the sharded ones plus the replicated ones)."""
    counts = param_counts(arch)
    return -(-counts["tp_sharded"] // tp) + counts["replicated"]


def stored_params_per_rank(arch: ArchSpec, tp: int) -> int:
    """Parameters a TP rank holds of every expert before FSDP sharding (:func:`params_per_rank` x experts)."""
    return params_per_rank(arch, tp) * arch.experts


def largest_block_params(arch: ArchSpec, tp: int) -> int:
    """Parameters of the largest block on one TP rank (what one FSDP all-gather unshards at once)."""
    best = 0
    for b in arch.blocks:
        sharded = _linear_params(b.held, "sharded") + b.tp_norm_params
        best = max(best, -(-sharded // tp) + _linear_params(b.held, "replicated") + b.norm_params)
    return best


def _target_matches(name: str, target: str) -> bool:
    """True when ``target`` is a whole dotted segment run of ``name`` (``ff`` matches ``ff.net.2``, not ``ffn``)."""
    padded, needle = f".{name}.", f".{target.strip('.')}."
    return needle in padded


def lora_params(arch: ArchSpec, rank: int, targets: tuple[str, ...]) -> dict[str, int]:
    """Adapter parameters of rank ``rank`` on every block linear matched by ``targets``: total and TP-sharded."""
    if rank < 0:
        raise UserError(f"LoRA rank must be >= 0, got {rank}")
    total = sharded = 0
    for block in arch.blocks:
        for lin in block.held:
            if rank and any(_target_matches(lin.name, t) for t in targets):
                total += block.count * rank * (lin.in_features + lin.out_features)
                # A column-parallel base shards B (out side); a row-parallel base shards A (in side).
                if lin.tp == "column":
                    sharded += block.count * rank * lin.out_features
                elif lin.tp == "row":
                    sharded += block.count * rank * lin.in_features
    return {"total": total, "tp_sharded": sharded, "replicated": total - sharded}


def lora_params_per_rank(arch: ArchSpec, rank: int, targets: tuple[str, ...], tp: int) -> int:
    """Adapter parameters one TP rank holds."""
    counts = lora_params(arch, rank, targets)
    return -(-counts["tp_sharded"] // tp) + counts["replicated"]


def forward_flops(arch: ArchSpec, tokens: dict[str, int], tp: int = 1) -> dict[str, float]:
    """FLOPs of one forward of one sample on one TP rank: ``linear`` (matmuls) and ``attention`` (QK^T and PV).

    A multiply-add is 2 FLOPs. TP splits the sharded linears (adaLN modulation included) and the attention heads;
    replicated linears (embeddings, output projection) run in full on every TP rank.
    """
    def matmuls(linears: tuple[LinearSpec, ...]) -> float:
        return sum(2.0 * lin.in_features * lin.out_features * tokens[lin.stream] / (1 if lin.tp == "replicated"
                   else tp) for lin in linears)

    linear = matmuls(arch.root) + sum(b.count * matmuls(b.linears) for b in arch.blocks)
    attention = 0.0
    for b in arch.blocks:
        for q_stream, kv_stream in b.attention:
            attention += b.count * 4.0 * tokens[q_stream] * tokens[kv_stream] * arch.hidden_size / tp
    return {"linear": linear, "attention": attention}


def tp_allreduce_elements(arch: ArchSpec, tokens: dict[str, int]) -> int:
    """Elements all-reduced over the TP group in one forward of one sample (outputs of row-parallel linears)."""
    layers = [(1, lin) for lin in arch.root] + [(b.count, lin) for b in arch.blocks for lin in b.linears]
    return sum(count * lin.out_features * tokens[lin.stream] for count, lin in layers if lin.tp == "row")


def self_attention_exchange_elements(arch: ArchSpec, tokens: dict[str, int]) -> int:
    """Elements of q, k, v and the output of every self-attention layer in one forward of one sample.

    What context parallelism's all-to-alls move (``models/common/context_parallel.py``), before dividing by TP
    and CP: 4 x S x hidden per layer, S the tokens of the layer's stream (FLUX: text + image in every block).
    Cross-attention to the text needs no exchange (local queries against the full text).
    """
    return sum(b.count * 4 * tokens[q] * arch.hidden_size for b in arch.blocks for q, kv in b.attention if q == kv)


# Root layers the last pipeline stage owns (the output norm / modulation and projection); the first owns the rest.
_OUTPUT_LAYERS = ("norm_out", "proj_out")


def stage_spec(arch: ArchSpec, pp: int, rank: int) -> ArchSpec:
    """Pipeline stage ``rank`` of ``pp`` as an :class:`ArchSpec`: its run of blocks (FLUX counts the double-stream
    blocks, then the single-stream ones), the embedders on the first stage, the output layers (and Wan's output
    scale-shift table) on the last, as the policies build their stages."""
    counts = stage_block_counts(arch.num_layers, pp)
    start = sum(counts[:rank])
    stop = start + counts[rank]
    blocks, offset = [], 0
    for block in arch.blocks:
        owned = max(min(stop, offset + block.count) - max(start, offset), 0)
        if owned:
            blocks.append(replace(block, count=owned))
        offset += block.count
    output = [lin.name.split(".")[0] in _OUTPUT_LAYERS for lin in arch.root]
    root = tuple(lin for lin, out in zip(arch.root, output)
                 if (out and rank == pp - 1) or (not out and rank == 0))
    return replace(arch, name=f"{arch.name} stage {rank}/{pp}" if pp > 1 else arch.name, root=root,
                   root_norm_params=arch.root_norm_params if rank == pp - 1 else 0, blocks=tuple(blocks))


def boundary_elements(arch: ArchSpec, tokens: dict[str, int]) -> int:
    """Elements of the one tensor a pipeline stage sends the next per sample and forward (``docs/models.md``):
    FLUX's, SD3's and Qwen-Image's ``[temb, text, image]`` rows, Wan ``[hidden states, temb, 6 modulation rows, text]``
    (per-sample timesteps; a Wan2.1-I2V's CLIP tokens after the text), each ``hidden_size`` wide."""
    rows = 1 + tokens["joint"] if arch.family in _IMAGE_FAMILIES else (
        tokens["image"] + 7 + tokens["text"] + tokens.get("clip", 0))
    return rows * arch.hidden_size


def _lin(name: str, fan_in: int, fan_out: int, stream: str, tp: str = "replicated") -> LinearSpec:
    return LinearSpec(name=name, in_features=fan_in, out_features=fan_out, stream=stream, tp=tp)


def flux_spec(config: dict, name: str = "flux") -> ArchSpec:
    """The :class:`ArchSpec` of a diffusers ``FluxTransformer2DModel`` config (missing keys: diffusers defaults)."""
    c = {"patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
         "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
         "pooled_projection_dim": 768, "guidance_embeds": False, **config}
    heads, head_dim = int(c["num_attention_heads"]), int(c["attention_head_dim"])
    d, p = heads * head_dim, int(c["patch_size"])
    in_ch, out_ch = int(c["in_channels"]), int(c["out_channels"] or c["in_channels"])
    mlp = 4 * d  # diffusers fixes mlp_ratio = 4 in both block kinds
    root = [_lin("x_embedder", in_ch, d, "image"), _lin("context_embedder", int(c["joint_attention_dim"]), d, "text"),
            _lin("time_text_embed.timestep_embedder.linear_1", 256, d, "sample"),
            _lin("time_text_embed.timestep_embedder.linear_2", d, d, "sample"),
            _lin("time_text_embed.text_embedder.linear_1", int(c["pooled_projection_dim"]), d, "sample"),
            _lin("time_text_embed.text_embedder.linear_2", d, d, "sample"),
            _lin("norm_out.linear", d, 2 * d, "sample", "column"), _lin("proj_out", d, p * p * out_ch, "image")]
    if c["guidance_embeds"]:
        root += [_lin("time_text_embed.guidance_embedder.linear_1", 256, d, "sample"),
                 _lin("time_text_embed.guidance_embedder.linear_2", d, d, "sample")]
    # adaLN modulation: column-parallel, its output all-gathered (the gather is (batch, chunks * d), negligible).
    double = [_lin("norm1.linear", d, 6 * d, "sample", "column"),
              _lin("norm1_context.linear", d, 6 * d, "sample", "column")]
    for proj in ("to_q", "to_k", "to_v"):
        double.append(_lin(f"attn.{proj}", d, d, "image", "column"))
    for proj in ("add_q_proj", "add_k_proj", "add_v_proj"):
        double.append(_lin(f"attn.{proj}", d, d, "text", "column"))
    double += [_lin("attn.to_out.0", d, d, "image", "row"), _lin("attn.to_add_out", d, d, "text", "row"),
               _lin("ff.net.0.proj", d, mlp, "image", "column"), _lin("ff.net.2", mlp, d, "image", "row"),
               _lin("ff_context.net.0.proj", d, mlp, "text", "column"),
               _lin("ff_context.net.2", mlp, d, "text", "row")]
    single = [_lin("norm.linear", d, 3 * d, "sample", "column")]
    single += [_lin(f"attn.{proj}", d, d, "joint", "column") for proj in ("to_q", "to_k", "to_v")]
    single += [_lin("proj_mlp", d, mlp, "joint", "column"), _lin("proj_out", d + mlp, d, "joint", "row")]
    blocks = (
        BlockSpec("double", int(c["num_layers"]), tuple(double), norm_params=4 * head_dim, tp_norm_params=0,
                  attention=(("joint", "joint"),), mlp_dim=mlp, stream="joint"),
        BlockSpec("single", int(c["num_single_layers"]), tuple(single), norm_params=2 * head_dim, tp_norm_params=0,
                  attention=(("joint", "joint"),), mlp_dim=mlp, stream="joint"),
    )
    return ArchSpec(family="flux", name=name, config=dict(c), hidden_size=d, num_heads=heads, head_dim=head_dim,
                    latent_channels=in_ch // 4, spatial_stride=16 * p, temporal_stride=1, temporal_patch=1,
                    vae_stride=FLUX_SPATIAL_FACTOR, root=tuple(root), root_norm_params=0, blocks=blocks)


def wan_spec(config: dict, name: str = "wan") -> ArchSpec:
    """The :class:`ArchSpec` of a diffusers ``WanTransformer3DModel`` config (missing keys: diffusers defaults)."""
    c = {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
         "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
         "cross_attn_norm": True, **config}
    if c.get("pos_embed_seq_len") is not None:
        raise UserError(f"{name}: Wan first-last-frame conditioning (pos_embed_seq_len) is not supported")
    heads, head_dim = int(c["num_attention_heads"]), int(c["attention_head_dim"])
    d, ffn = heads * head_dim, int(c["ffn_dim"])
    pt, ph, pw = (int(v) for v in c["patch_size"])
    if ph != pw:
        raise UserError(f"{name}: the planner needs a square spatial patch, got {c['patch_size']}")
    in_ch, out_ch = int(c["in_channels"]), int(c["out_channels"] or c["in_channels"])
    vae_s = spatial_factor("wan", c)
    vae_t = int(c.get("vae_scale_factor_temporal") or 4)
    volume = pt * ph * pw
    root = (_lin("patch_embedding", in_ch * volume, d, "image"),
            _lin("condition_embedder.time_embedder.linear_1", int(c["freq_dim"]), d, "sample"),
            _lin("condition_embedder.time_embedder.linear_2", d, d, "sample"),
            _lin("condition_embedder.time_proj", d, 6 * d, "sample", "column"),
            _lin("condition_embedder.text_embedder.linear_1", int(c["text_dim"]), d, "text", "column"),
            _lin("condition_embedder.text_embedder.linear_2", d, d, "text", "row"),
            _lin("proj_out", d, out_ch * volume, "image"))
    block = [_lin(f"attn1.{proj}", d, d, "image", "column") for proj in ("to_q", "to_k", "to_v")]
    block += [_lin("attn1.to_out", d, d, "image", "row"), _lin("attn2.to_q", d, d, "image", "column"),
              _lin("attn2.to_k", d, d, "text", "column"), _lin("attn2.to_v", d, d, "text", "column"),
              _lin("attn2.to_out", d, d, "image", "row"), _lin("ffn.fc1", d, ffn, "image", "column"),
              _lin("ffn.fc2", ffn, d, "image", "row")]
    norm = 6 * d + (2 * d if c["cross_attn_norm"] else 0)  # scale-shift table + affine cross-attention norm
    attention, root_norms, image = (("image", "image"), ("image", "text")), 2 * d, c.get("image_dim")
    if image is not None:  # Wan2.1-I2V: the CLIP tokens' embedder and each block's image keys and values
        root += (_lin("condition_embedder.image_embedder.fc1", int(image), int(image), "clip"),
                 _lin("condition_embedder.image_embedder.fc2", int(image), d, "clip"))
        root_norms += 2 * int(image) + 2 * d
        block += [_lin("attn2.add_k_proj", d, d, "clip", "column"), _lin("attn2.add_v_proj", d, d, "clip", "column")]
        attention += (("image", "clip"),)
    blocks = (BlockSpec("wan", int(c["num_layers"]), tuple(block), norm_params=norm,
                        tp_norm_params=(5 if image is not None else 4) * d, attention=attention, mlp_dim=ffn,
                        stream="image"),)
    # the sampler's latents have the output's channels (an I2V checkpoint reads its conditioning channels beside)
    return ArchSpec(family="wan", name=name, config=dict(c), hidden_size=d, num_heads=heads,
                    head_dim=head_dim, latent_channels=out_ch, spatial_stride=vae_s * ph, temporal_stride=vae_t,
                    temporal_patch=pt, vae_stride=vae_s, root=root, root_norm_params=root_norms, blocks=blocks,
                    experts=1 if c.get("boundary_ratio") is None else 2,
                    image_tokens=CLIP_TOKENS if image is not None else 0)


def _sd3_block(c: dict, *, dual: bool, last: bool) -> tuple[LinearSpec, ...]:
    """The linears of one SD3 joint block (``dual``: MMDiT-X's image-only attn2; ``last``: context-pre-only)."""
    d = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    mlp = 4 * d  # diffusers' FeedForward mult
    block = [_lin("norm1.linear", d, (9 if dual else 6) * d, "sample", "column"),
             _lin("norm1_context.linear", d, (2 if last else 6) * d, "sample", "column")]
    block += [_lin(f"attn.{proj}", d, d, "image", "column") for proj in ("to_q", "to_k", "to_v")]
    block += [_lin(f"attn.{proj}", d, d, "text", "column") for proj in ("add_q_proj", "add_k_proj", "add_v_proj")]
    block += [_lin("attn.to_out.0", d, d, "image", "row"), _lin("ff.net.0.proj", d, mlp, "image", "column"),
              _lin("ff.net.2", mlp, d, "image", "row")]
    if dual:
        block += [_lin(f"attn2.{proj}", d, d, "image", "column") for proj in ("to_q", "to_k", "to_v")]
        block.append(_lin("attn2.to_out.0", d, d, "image", "row"))
    if not last:
        block += [_lin("attn.to_add_out", d, d, "text", "row"), _lin("ff_context.net.0.proj", d, mlp, "text", "column"),
                  _lin("ff_context.net.2", mlp, d, "text", "row")]
    return tuple(block)


def sd3_spec(config: dict, name: str = "sd3") -> ArchSpec:
    """The :class:`ArchSpec` of a diffusers ``SD3Transformer2DModel`` config (missing keys: diffusers defaults).

    Blocks of one kind are consecutive runs: MMDiT-X blocks (``dual_attention_layers``), plain joint blocks and
    the context-pre-only last block, in execution order. The positional table is a buffer, not a parameter.
    """
    c = {"patch_size": 2, "in_channels": 16, "num_layers": 18, "attention_head_dim": 64, "num_attention_heads": 18,
         "joint_attention_dim": 4096, "caption_projection_dim": 1152, "pooled_projection_dim": 2048,
         "out_channels": 16, "dual_attention_layers": [], "qk_norm": None, **config}
    heads, head_dim, layers = int(c["num_attention_heads"]), int(c["attention_head_dim"]), int(c["num_layers"])
    d, p, in_ch = heads * head_dim, int(c["patch_size"]), int(c["in_channels"])
    out_ch, dual = int(c["out_channels"] or in_ch), set(int(i) for i in c["dual_attention_layers"] or ())
    root = (_lin("pos_embed.proj", in_ch * p * p, d, "image"),
            _lin("context_embedder", int(c["joint_attention_dim"]), int(c["caption_projection_dim"]), "text"),
            _lin("time_text_embed.timestep_embedder.linear_1", 256, d, "sample"),
            _lin("time_text_embed.timestep_embedder.linear_2", d, d, "sample"),
            _lin("time_text_embed.text_embedder.linear_1", int(c["pooled_projection_dim"]), d, "sample"),
            _lin("time_text_embed.text_embedder.linear_2", d, d, "sample"),
            _lin("norm_out.linear", d, 2 * d, "sample", "column"), _lin("proj_out", d, p * p * out_ch, "image"))
    qk = 1 if c["qk_norm"] else 0  # per-head q/k RMSNorm weights, replicated over TP
    runs: list[BlockSpec] = []
    for i in range(layers):
        kind = "last" if i == layers - 1 else ("dual" if i in dual else "joint")
        if runs and runs[-1].kind == kind:
            runs[-1] = replace(runs[-1], count=runs[-1].count + 1)
            continue
        attention = (("joint", "joint"), ("image", "image")) if i in dual else (("joint", "joint"),)
        runs.append(BlockSpec(kind, 1, _sd3_block(c, dual=i in dual, last=kind == "last"),
                              norm_params=qk * (6 if i in dual else 4) * head_dim, tp_norm_params=0,
                              attention=attention, mlp_dim=4 * d, stream="joint"))
    return ArchSpec(family="sd3", name=name, config=dict(c), hidden_size=d, num_heads=heads, head_dim=head_dim,
                    latent_channels=in_ch, spatial_stride=SD3_SPATIAL_FACTOR * p, temporal_stride=1,
                    temporal_patch=1, vae_stride=SD3_SPATIAL_FACTOR, root=root, root_norm_params=0,
                    blocks=tuple(runs))


def qwen_image_spec(config: dict, name: str = "qwen_image") -> ArchSpec:
    """The :class:`ArchSpec` of a diffusers ``QwenImageTransformer2DModel`` config (missing keys: diffusers defaults):
    dual-stream blocks with per-stream modulation and MLPs, the text entering through an RMSNorm (``txt_norm``)."""
    c = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
         "num_attention_heads": 24, "joint_attention_dim": 3584, **config}
    heads, head_dim = int(c["num_attention_heads"]), int(c["attention_head_dim"])
    d, p, text_dim = heads * head_dim, int(c["patch_size"]), int(c["joint_attention_dim"])
    in_ch, out_ch, mlp = int(c["in_channels"]), int(c["out_channels"] or c["in_channels"]), 4 * heads * head_dim
    root = (_lin("img_in", in_ch, d, "image"), _lin("txt_in", text_dim, d, "text"),
            _lin("time_text_embed.timestep_embedder.linear_1", 256, d, "sample"),
            _lin("time_text_embed.timestep_embedder.linear_2", d, d, "sample"),
            _lin("norm_out.linear", d, 2 * d, "sample", "column"), _lin("proj_out", d, p * p * out_ch, "image"))
    block = [_lin(f"{s}_mod.1", d, 6 * d, "sample", "column") for s in ("img", "txt")]
    block += [_lin(f"attn.{proj}", d, d, "image", "column") for proj in ("to_q", "to_k", "to_v")]
    block += [_lin(f"attn.{proj}", d, d, "text", "column") for proj in ("add_q_proj", "add_k_proj", "add_v_proj")]
    block += [_lin("attn.to_out.0", d, d, "image", "row"), _lin("attn.to_add_out", d, d, "text", "row")]
    for stream, prefix in (("image", "img"), ("text", "txt")):
        block += [_lin(f"{prefix}_mlp.net.0.proj", d, mlp, stream, "column"),
                  _lin(f"{prefix}_mlp.net.2", mlp, d, stream, "row")]
    # The last block's text output is unread: it holds, but does not run, its text projection and MLP.
    unread = ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    kind = dict(norm_params=4 * head_dim, tp_norm_params=0, attention=(("joint", "joint"),), mlp_dim=mlp,
                stream="joint")
    blocks = (BlockSpec("qwen", int(c["num_layers"]) - 1, tuple(block), **kind),
              BlockSpec("qwen_last", 1, tuple(lin for lin in block if lin.name not in unread), **kind,
                        idle=tuple(lin for lin in block if lin.name in unread)))
    return ArchSpec(family="qwen_image", name=name, config=dict(c), hidden_size=d, num_heads=heads,
                    head_dim=head_dim, latent_channels=in_ch // 4, spatial_stride=2 * QWEN_IMAGE_SPATIAL_FACTOR,
                    temporal_stride=1, temporal_patch=1, vae_stride=QWEN_IMAGE_SPATIAL_FACTOR, root=root,
                    root_norm_params=text_dim, blocks=blocks)


def arch_from_config(family: str, config: dict, name: Optional[str] = None) -> ArchSpec:
    """Build the spec of ``family`` ("flux", "sd3", "wan" or "qwen_image") from a diffusers-style config dict."""
    if not isinstance(config, dict):
        raise UserError(f"a model config must be a mapping, got {type(config).__name__}")
    builders = {"flux": flux_spec, "sd3": sd3_spec, "wan": wan_spec, "qwen_image": qwen_image_spec}
    if family not in builders:
        raise UserError(f"unknown model family {family!r} (expected flux, sd3, wan or qwen_image)")
    return builders[family](config, name or family)


def family_of_class(class_name: Optional[str]) -> str:
    """The family of a diffusers ``_class_name``."""
    if class_name in _CLASS_FAMILIES:
        return _CLASS_FAMILIES[class_name]
    raise UserError(f"cannot plan for model class {class_name!r} (expected one of {sorted(_CLASS_FAMILIES)})")


def load_arch(model: str) -> ArchSpec:
    """A built-in model name, a diffusers ``config.json`` / transformer directory / pipeline root, or a leangrpo
    checkpoint."""
    if model in BUILTIN_PRESETS:
        family, config = BUILTIN_PRESETS[model]
        return arch_from_config(family, config, model)
    path = model
    experts = {}
    if os.path.isfile(os.path.join(path, "model_index.json")) and os.path.isdir(os.path.join(path, "transformer")):
        index = _read_json(os.path.join(path, "model_index.json"))
        if index.get("boundary_ratio") is not None and (index.get("transformer_2") or [None])[0] is not None:
            experts = {"boundary_ratio": index["boundary_ratio"]}  # two experts of transformer/'s architecture
        path = os.path.join(path, "transformer")  # a diffusers pipeline root: its policy
    if os.path.isdir(path):
        ours = os.path.join(path, "leangrpo_model.json")
        if os.path.isfile(ours):
            meta = _read_json(ours)
            return arch_from_config(str(meta.get("family")), meta.get("config") or {}, os.path.basename(path))
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"unknown model {model!r}: not one of {sorted(BUILTIN_PRESETS)} and no config file there")
    config = {**_read_json(path), **experts}
    return arch_from_config(family_of_class(config.get("_class_name")), config, os.path.basename(model.rstrip("/")))


def preset_config(family: str, preset: str) -> dict:
    """The diffusers-style config of a named preset: built-in ones here, others from the models package."""
    if preset in BUILTIN_PRESETS and BUILTIN_PRESETS[preset][0] == family:
        return dict(BUILTIN_PRESETS[preset][1])
    # Imported lazily: the models package pulls in torch and megatron-core, which the planner avoids otherwise.
    from leangrpo_mcore.models import get_family

    presets = get_family(family).presets
    if preset not in presets:
        raise UserError(f"unknown {family} preset {preset!r} (known: {sorted(presets)})")
    return dict(presets[preset])


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read model config {path}: {err}") from err
    if not isinstance(data, dict):
        raise UserError(f"model config {path} is not a JSON object")
    return data
