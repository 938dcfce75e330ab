"""FLUX.1 hyper-parameters on top of megatron-core's TransformerConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron.core.transformer import TransformerConfig

from leangrpo_mcore.models.common.widths import derive_attention_widths

VAE_SCALE_FACTOR = 8
"""FLUX.1's VAE downsamples each image side by 8."""
LATENT_PACKING = 2
"""The FLUX pipeline packs 2x2 latent pixels into one token (16 VAE channels -> 64 in_channels)."""

_DIFFUSERS_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers",
                   "attention_head_dim", "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
                   "guidance_embeds", "axes_dims_rope")


@dataclass
class FluxConfig(TransformerConfig):
    """FluxTransformer2DModel hyper-parameters (diffusers' config.json names where they exist).

    megatron's ``num_layers`` is the total block count (double + single stream), ``hidden_size`` is
    ``num_attention_heads * attention_head_dim`` and ``ffn_hidden_size`` is ``mlp_ratio * hidden_size``;
    all three are derived when left at 0 / None.
    """

    patch_size: int = 1
    """Spatial patch size applied by the model (FLUX.1 uses 1: the pipeline packs 2x2 latents)."""
    in_channels: int = 64
    """Channels per input token."""
    out_channels: Optional[int] = None
    """Channels per output token; None means ``in_channels``."""
    num_double_layers: int = 19
    """Double-stream (MMDiT) blocks: diffusers' ``num_layers``."""
    num_single_layers: int = 38
    """Single-stream blocks."""
    attention_head_dim: int = 128
    """Channels per attention head; must equal ``sum(axes_dims_rope)``."""
    joint_attention_dim: int = 4096
    """Channels of the text-encoder sequence (T5) fed to ``context_embedder``."""
    pooled_projection_dim: int = 768
    """Channels of the pooled text embedding (CLIP)."""
    guidance_embeds: bool = False
    """Embed a guidance scale (FLUX.1-dev: True; schnell: False)."""
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    """RoPE channels per position axis (text/id axis, row, column)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    mlp_ratio: float = 4.0
    """MLP hidden size over hidden size (double-stream ff and single-stream proj_mlp)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant)."""

    num_attention_heads: int = 24
    use_cpu_initialization: bool = True
    gradient_accumulation_fusion: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    num_layers: int = 0
    hidden_size: int = 0
    layernorm_epsilon: float = 1e-6

    def __post_init__(self) -> None:
        self.axes_dims_rope = tuple(int(d) for d in self.axes_dims_rope)
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"sum(axes_dims_rope) = {sum(self.axes_dims_rope)} must equal attention_head_dim = "
                             f"{self.attention_head_dim}")
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"every axes_dims_rope entry must be even, got {self.axes_dims_rope}")
        blocks = self.num_double_layers + self.num_single_layers
        if self.num_layers == 0:
            self.num_layers = blocks
        elif self.num_layers != blocks:
            raise ValueError(f"num_layers ({self.num_layers}) must equal num_double_layers + num_single_layers "
                             f"({blocks})")
        derive_attention_widths(self)
        super().__post_init__()

    @property
    def output_channels(self) -> int:
        """Channels per output token (``out_channels`` or ``in_channels``)."""
        return self.out_channels or self.in_channels

    @classmethod
    def from_diffusers_config(cls, d: dict) -> "FluxConfig":
        """Build from diffusers' config.json hyper-parameters (keys starting with ``_`` are ignored)."""
        hyper = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = sorted(set(hyper) - set(_DIFFUSERS_KEYS))
        if unknown:
            raise ValueError(f"not a FluxTransformer2DModel config: unknown keys {unknown}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        return cls(
            patch_size=int(hyper.get("patch_size", defaults["patch_size"])),
            in_channels=int(hyper.get("in_channels", defaults["in_channels"])),
            out_channels=hyper.get("out_channels", defaults["out_channels"]),
            num_double_layers=int(hyper.get("num_layers", defaults["num_double_layers"])),
            num_single_layers=int(hyper.get("num_single_layers", defaults["num_single_layers"])),
            attention_head_dim=int(hyper.get("attention_head_dim", defaults["attention_head_dim"])),
            num_attention_heads=int(hyper.get("num_attention_heads", defaults["num_attention_heads"])),
            joint_attention_dim=int(hyper.get("joint_attention_dim", defaults["joint_attention_dim"])),
            pooled_projection_dim=int(hyper.get("pooled_projection_dim", defaults["pooled_projection_dim"])),
            guidance_embeds=bool(hyper.get("guidance_embeds", defaults["guidance_embeds"])),
            axes_dims_rope=tuple(hyper.get("axes_dims_rope", defaults["axes_dims_rope"])),
        )

    def to_diffusers_config(self) -> dict:
        """The diffusers config.json hyper-parameters (without ``_class_name``)."""
        return {
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "num_layers": self.num_double_layers,
            "num_single_layers": self.num_single_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "pooled_projection_dim": self.pooled_projection_dim,
            "guidance_embeds": self.guidance_embeds,
            "axes_dims_rope": list(self.axes_dims_rope),
        }


def _flux(guidance: bool) -> dict:
    return {"patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
            "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "guidance_embeds": guidance, "axes_dims_rope": [16, 56, 56]}


_TINY = {"patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 1, "num_single_layers": 1,
         "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 24,
         "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}

PRESETS: dict[str, dict] = {
    "flux-dev": _flux(guidance=True),
    "flux-schnell": _flux(guidance=False),
    # FLUX.1-Kontext-dev shares FLUX.1-dev's transformer layout; what makes it an editor is the conditioning image
    # (data.images), whose tokens it attends to beside the generated ones.
    "flux-kontext-dev": _flux(guidance=True),
    "flux-tiny": dict(_TINY),
    "flux-kontext-tiny": dict(_TINY),
}
