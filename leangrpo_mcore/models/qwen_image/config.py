"""Qwen-Image (QwenImageTransformer2DModel) hyper-parameters on top of megatron-core's TransformerConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer import TransformerConfig

from leangrpo_mcore.models.common.widths import derive_attention_widths

DIFFUSERS_CLASS_NAME = "QwenImageTransformer2DModel"
VAE_SCALE_FACTOR = 8
"""Qwen-Image's VAE (``AutoencoderKLQwenImage``, 16 latent channels) downsamples each image side by 8."""
LATENT_PACKING = 2
"""QwenImagePipeline packs 2x2 latent pixels into one token (16 VAE channels -> 64 in_channels), as FLUX's."""

_DIFFUSERS_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                   "num_attention_heads", "joint_attention_dim", "guidance_embeds", "axes_dims_rope")
_UNSUPPORTED = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
"""diffusers switches of other Qwen-Image releases (guidance distillation, Edit-2511's zero-timestep condition,
Layered's extra conditions and 3-D RoPE): accepted when off, refused when on."""


@dataclass
class QwenImageConfig(TransformerConfig):
    """QwenImageTransformer2DModel hyper-parameters (diffusers' config.json names).

    ``hidden_size`` is ``num_attention_heads * attention_head_dim`` and ``ffn_hidden_size`` is
    ``mlp_ratio * hidden_size``; both are derived when left at 0.
    """

    patch_size: int = 2
    """Side of the latent patch of one token; the pipeline packs the patches, the model only unpacks its output
    (``proj_out`` has ``patch_size² · out_channels`` outputs)."""
    in_channels: int = 64
    """Channels per input token (16 latent channels x a 2x2 patch)."""
    out_channels: Optional[int] = 16
    """Latent channels per output patch position; None means ``in_channels``."""
    attention_head_dim: int = 128
    """Channels per attention head; must equal ``sum(axes_dims_rope)``."""
    joint_attention_dim: int = 3584
    """Channels of the text sequence (Qwen2.5-VL's last hidden states) fed to ``txt_norm`` and ``txt_in``."""
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    """RoPE channels per position axis (frame, row, column); the text tokens use all three."""
    rope_theta: float = 10000.0
    """RoPE base."""
    mlp_ratio: float = 4.0
    """MLP hidden size over hidden size (diffusers' FeedForward ``mult``)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant)."""

    num_layers: int = 60
    num_attention_heads: int = 24
    use_cpu_initialization: bool = True
    gradient_accumulation_fusion: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    hidden_size: int = 0
    layernorm_epsilon: float = 1e-6

    def __post_init__(self) -> None:
        self.axes_dims_rope = tuple(int(d) for d in self.axes_dims_rope)
        if len(self.axes_dims_rope) != 3 or any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope must be three even sizes (frame, row, column), got "
                             f"{list(self.axes_dims_rope)}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"sum(axes_dims_rope) = {sum(self.axes_dims_rope)} must equal attention_head_dim = "
                             f"{self.attention_head_dim}")
        derive_attention_widths(self)
        super().__post_init__()

    @property
    def output_channels(self) -> int:
        """Latent channels per output patch position (``out_channels`` or ``in_channels``)."""
        return self.out_channels or self.in_channels

    @classmethod
    def from_diffusers_config(cls, d: dict) -> "QwenImageConfig":
        """Build from diffusers' config.json hyper-parameters (keys starting with ``_`` are ignored)."""
        hyper = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = sorted(set(hyper) - set(_DIFFUSERS_KEYS) - set(_UNSUPPORTED))
        if unknown:
            raise ValueError(f"not a {DIFFUSERS_CLASS_NAME} config: unknown keys {unknown}")
        switched = [key for key in _UNSUPPORTED if hyper.get(key)]
        if switched:
            raise ValueError(f"{DIFFUSERS_CLASS_NAME} with {switched[0]}=true (another Qwen-Image release) is not "
                             "supported: this family is the text-to-image model")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        ints = ("patch_size", "in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
                "joint_attention_dim")
        values = {key: int(hyper.get(key, defaults[key])) for key in ints}
        out = hyper.get("out_channels", defaults["out_channels"])
        return cls(**values, out_channels=None if out is None else int(out),
                   axes_dims_rope=tuple(hyper.get("axes_dims_rope", defaults["axes_dims_rope"])))

    def to_diffusers_config(self) -> dict:
        """The diffusers config.json hyper-parameters (without ``_class_name``)."""
        return {
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "num_layers": self.num_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "guidance_embeds": False,
            "axes_dims_rope": list(self.axes_dims_rope),
        }


PRESETS: dict[str, dict] = {
    # Qwen/Qwen-Image transformer/config.json (20.4 B parameters).
    "qwen-image": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                   "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                   "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]},
    # The same shape at test size: 16 latent channels packed 2x2, two blocks, 2 heads of 16 channels.
    "qwen-image-tiny": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2,
                        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 24,
                        "guidance_embeds": False, "axes_dims_rope": [4, 6, 6]},
}
