"""Stable Diffusion 3 / 3.5 (SD3Transformer2DModel) hyper-parameters on top of megatron-core's TransformerConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer import TransformerConfig

from leangrpo_mcore.models.common.widths import derive_attention_widths

DIFFUSERS_CLASS_NAME = "SD3Transformer2DModel"
VAE_SCALE_FACTOR = 8
"""The SD3 VAE (16 latent channels) downsamples each image side by 8."""
QK_NORMS = (None, "rms_norm")
"""The q/k normalisations implemented (SD3.0: none; SD3.5: per-head RMSNorm)."""

_DIFFUSERS_KEYS = ("sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim",
                   "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim",
                   "out_channels", "pos_embed_max_size", "dual_attention_layers", "qk_norm")


@dataclass
class SD3Config(TransformerConfig):
    """SD3Transformer2DModel hyper-parameters (diffusers' config.json names).

    ``hidden_size`` is ``num_attention_heads * attention_head_dim`` and ``ffn_hidden_size`` is
    ``mlp_ratio * hidden_size``; both are derived when left at 0.
    """

    sample_size: int = 128
    """Latent side the positional table is centred on (its ``base_size`` is ``sample_size / patch_size``)."""
    patch_size: int = 2
    """Side of the square latent patch that becomes one token."""
    in_channels: int = 16
    """Latent channels of the input."""
    out_channels: Optional[int] = 16
    """Latent channels of the output; None means ``in_channels``."""
    attention_head_dim: int = 64
    """Channels per attention head."""
    joint_attention_dim: int = 4096
    """Channels of the text sequence (CLIP-L + CLIP-G padded to T5's width, then T5) fed to ``context_embedder``."""
    caption_projection_dim: int = 1536
    """Output of ``context_embedder``; the joint blocks need it equal to ``hidden_size``."""
    pooled_projection_dim: int = 2048
    """Channels of the pooled text embedding (CLIP-L pooled + CLIP-G pooled)."""
    pos_embed_max_size: int = 96
    """Side of the fixed sin-cos positional grid, cropped at its centre to the token grid."""
    dual_attention_layers: tuple[int, ...] = ()
    """Blocks with a second, image-only self-attention (MMDiT-X; SD3.5-M: 0..12)."""
    qk_norm: Optional[str] = None
    """Per-head q/k normalisation: None or "rms_norm"."""
    mlp_ratio: float = 4.0
    """MLP hidden size over hidden size (diffusers' FeedForward ``mult``)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant)."""

    num_layers: int = 24
    num_attention_heads: int = 24
    use_cpu_initialization: bool = True
    gradient_accumulation_fusion: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    hidden_size: int = 0
    layernorm_epsilon: float = 1e-6

    def __post_init__(self) -> None:
        self.dual_attention_layers = tuple(sorted(int(i) for i in self.dual_attention_layers))
        if any(not 0 <= i < self.num_layers for i in self.dual_attention_layers):
            raise ValueError(f"dual_attention_layers {list(self.dual_attention_layers)} must index the "
                             f"{self.num_layers} blocks")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        hidden = derive_attention_widths(self)
        if self.caption_projection_dim != hidden:
            raise ValueError(f"caption_projection_dim ({self.caption_projection_dim}) must equal the model width "
                             f"num_attention_heads * attention_head_dim ({hidden})")
        if self.pos_embed_max_size < 1 or self.sample_size % self.patch_size:
            raise ValueError(f"pos_embed_max_size must be positive and sample_size ({self.sample_size}) a multiple "
                             f"of patch_size ({self.patch_size})")
        if hidden % 4:
            raise ValueError(f"the 2-D sin-cos positions need a model width divisible by 4, got {hidden}")
        super().__post_init__()

    @property
    def output_channels(self) -> int:
        """Latent channels of the output (``out_channels`` or ``in_channels``)."""
        return self.out_channels or self.in_channels

    def is_dual(self, block: int) -> bool:
        """Whether block ``block`` has the image-only second attention."""
        return block in self.dual_attention_layers

    def is_context_pre_only(self, block: int) -> bool:
        """Whether block ``block`` only reads the text stream (the last block: no text output)."""
        return block == self.num_layers - 1

    @classmethod
    def from_diffusers_config(cls, d: dict) -> "SD3Config":
        """Build from diffusers' config.json hyper-parameters (keys starting with ``_`` are ignored)."""
        hyper = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = sorted(set(hyper) - set(_DIFFUSERS_KEYS))
        if unknown:
            raise ValueError(f"not a {DIFFUSERS_CLASS_NAME} config: unknown keys {unknown}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        ints = ("sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim",
                "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim",
                "pos_embed_max_size")
        values = {key: int(hyper.get(key, defaults[key])) for key in ints}
        out = hyper.get("out_channels", defaults["out_channels"])
        return cls(**values, out_channels=None if out is None else int(out),
                   dual_attention_layers=tuple(hyper.get("dual_attention_layers", ()) or ()),
                   qk_norm=hyper.get("qk_norm", defaults["qk_norm"]))

    def to_diffusers_config(self) -> dict:
        """The diffusers config.json hyper-parameters (without ``_class_name``)."""
        return {
            "sample_size": self.sample_size,
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "num_layers": self.num_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "caption_projection_dim": self.caption_projection_dim,
            "pooled_projection_dim": self.pooled_projection_dim,
            "out_channels": self.out_channels,
            "pos_embed_max_size": self.pos_embed_max_size,
            "dual_attention_layers": list(self.dual_attention_layers),
            "qk_norm": self.qk_norm,
        }


PRESETS: dict[str, dict] = {
    # stabilityai/stable-diffusion-3.5-medium transformer/config.json: MMDiT-X, dual attention in blocks 0-12.
    "sd3.5-medium": {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
                     "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                     "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "out_channels": 16,
                     "pos_embed_max_size": 384, "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm"},
    # stabilityai/stable-diffusion-3.5-large transformer/config.json.
    "sd3.5-large": {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38,
                    "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
                    "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "out_channels": 16,
                    "pos_embed_max_size": 192, "dual_attention_layers": [], "qk_norm": "rms_norm"},
    # An SD3.5-M-like shape for tests: dual attention in the first two of three blocks, the last context-pre-only.
    "sd3-tiny": {"sample_size": 8, "patch_size": 2, "in_channels": 16, "num_layers": 3, "attention_head_dim": 8,
                 "num_attention_heads": 4, "joint_attention_dim": 24, "caption_projection_dim": 32,
                 "pooled_projection_dim": 20, "out_channels": 16, "pos_embed_max_size": 16,
                 "dual_attention_layers": [0, 1], "qk_norm": "rms_norm"},
}
