"""Configuration of the Wan text-to-video transformer (diffusers ``WanTransformer3DModel``).

:class:`WanConfig` is a megatron-core ``TransformerConfig`` (so the layer backends, tensor parallelism and
activation recompute read the fields they know) extended with Wan's own hyper-parameters. It converts from and
to the hyper-parameters of diffusers' ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.vae_factors import wan_spatial_factor

DIFFUSERS_CLASS_NAME = "WanTransformer3DModel"
EXPERTS = ("high", "low")
"""Our names of a two-expert policy's transformers, in diffusers' order."""
DIFFUSERS_EXPERTS = {"high": "transformer", "low": "transformer_2"}
"""Our expert name -> the pipeline component (subfolder) that diffusers stores it as."""
NUM_TRAIN_TIMESTEPS = 1000
"""The schedulers' ``num_train_timesteps`` that ``boundary_ratio`` scales (every released Wan pipeline's)."""
QK_NORM_ACROSS_HEADS = "rms_norm_across_heads"

# Keys of diffusers' WanTransformer3DModel config that this implementation reads (private "_..." keys such as
# _class_name / _diffusers_version are metadata and ignored).
_DIFFUSERS_KEYS = (
    "patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
    "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps", "image_dim", "added_kv_proj_dim",
    "rope_max_seq_len", "pos_embed_seq_len",
)

# diffusers' constructor defaults, used for keys a config.json leaves out.
_DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": QK_NORM_ACROSS_HEADS, "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}


@dataclass
class WanConfig(TransformerConfig):
    """Wan T2V transformer hyper-parameters on top of megatron-core's ``TransformerConfig``.

    ``hidden_size = num_attention_heads * kv_channels`` (diffusers' inner_dim), ``kv_channels`` is diffusers'
    ``attention_head_dim``, ``ffn_hidden_size`` its ``ffn_dim`` and ``layernorm_epsilon`` its ``eps``.
    """

    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(t, h, w) patch of the 3-D patch embedding, in latent pixels."""
    in_channels: int = 16
    """Latent channels of the input video."""
    out_channels: int = 16
    """Latent channels of the predicted velocity."""
    text_dim: int = 4096
    """Width of the text encoder's hidden states (UMT5-XXL: 4096)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding."""
    cross_attn_norm: bool = True
    """Affine LayerNorm before the cross-attention (identity when False)."""
    qk_norm: Optional[str] = QK_NORM_ACROSS_HEADS
    """Query/key normalisation; only RMSNorm across all heads (the released models) is supported."""
    rope_max_seq_len: int = 1024
    """Positions per axis of the precomputed 3-D rotary table."""
    image_dim: Optional[int] = None
    """Width of the CLIP image tokens of Wan2.1-I2V (1280: ViT-H/14's penultimate hidden states), embedded by
    ``condition_embedder.image_embedder``; None: no image tokens."""
    added_kv_proj_dim: Optional[int] = None
    """Input width of the cross-attention's image key/value projections (``add_k_proj``/``add_v_proj``): the
    embedded image tokens, so the model width; set with ``image_dim``."""
    pos_embed_seq_len: Optional[int] = None
    """Image positional-embedding length of the FLF2V variants (unsupported: must be None)."""
    boundary_ratio: Optional[float] = None
    """Two experts (Wan2.2-A14B): denoising steps with timestep >= boundary_ratio * 1000 run the high-noise
    expert, the others the low-noise one, both of this architecture (diffusers' ``WanPipeline(transformer=...,
    transformer_2=..., boundary_ratio=...)``); None: one transformer."""
    vae_scale_factor_temporal: int = 4
    """Frames per latent frame of the paired VAE (first frame alone), used by ``tokens_for``."""
    vae_scale_factor_spatial: Optional[int] = None
    """Pixels per latent pixel of the paired VAE; None = 16 for the 48-channel Wan2.2 VAE, else 8."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant)."""

    def __post_init__(self) -> None:
        self._check_wan_fields()
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        self.vae_scale_factor_spatial = wan_spatial_factor(self.in_channels, self.vae_scale_factor_spatial)
        super().__post_init__()

    def _check_wan_fields(self) -> None:
        if self.num_layers <= 0 or self.hidden_size <= 0 or self.num_attention_heads <= 0:
            raise UserError("WanConfig needs positive num_layers, hidden_size and num_attention_heads")
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"Wan hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads != self.hidden_size:
            raise UserError("Wan needs hidden_size == num_attention_heads * kv_channels (attention_head_dim)")
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise UserError(f"Wan patch_size must be three positive ints, got {self.patch_size}")
        if self.qk_norm != QK_NORM_ACROSS_HEADS:
            raise UserError(f"Wan qk_norm {self.qk_norm!r} is not supported (only {QK_NORM_ACROSS_HEADS!r})")
        if self.pos_embed_seq_len is not None:
            raise UserError(f"Wan first-last-frame conditioning (FLF2V, pos_embed_seq_len="
                            f"{self.pos_embed_seq_len}) is not supported")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise UserError("Wan image tokens need both image_dim and added_kv_proj_dim (the I2V checkpoints set both)")
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.hidden_size:
            raise UserError(f"Wan added_kv_proj_dim {self.added_kv_proj_dim} must be the model width "
                            f"{self.hidden_size}: the image keys and values project the embedded image tokens")
        if self.in_channels < self.out_channels:
            raise UserError(f"Wan in_channels {self.in_channels} < out_channels {self.out_channels}")
        if self.boundary_ratio is not None and not 0.0 < float(self.boundary_ratio) < 1.0:
            raise UserError(f"Wan boundary_ratio must be in (0, 1), got {self.boundary_ratio}")
        if self.recompute_granularity is not None:
            raise UserError("Wan recomputes whole blocks: set activation_checkpointing, not recompute_granularity")

    @property
    def attention_head_dim(self) -> int:
        """Channels per attention head (diffusers' ``attention_head_dim``)."""
        return int(self.kv_channels)

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any], **overrides: Any) -> "WanConfig":
        """Build from diffusers' ``config.json`` hyper-parameters; ``overrides`` set TransformerConfig fields."""
        if not isinstance(d, dict):
            raise UserError(f"a Wan config must be a dict, got {type(d).__name__}")
        class_name = d.get("_class_name", DIFFUSERS_CLASS_NAME)
        if class_name != DIFFUSERS_CLASS_NAME:
            raise UserError(f"not a Wan transformer config: _class_name is {class_name!r}")
        own = {"vae_scale_factor_temporal", "vae_scale_factor_spatial", "boundary_ratio"}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in _DIFFUSERS_KEYS and k not in own)
        if unknown:
            raise UserError(f"unknown keys in the Wan transformer config: {unknown}")
        h = {**_DIFFUSERS_DEFAULTS, **{k: v for k, v in d.items() if k in _DIFFUSERS_KEYS}}
        heads, head_dim = int(h["num_attention_heads"]), int(h["attention_head_dim"])
        kwargs: dict[str, Any] = dict(
            num_layers=int(h["num_layers"]),
            hidden_size=heads * head_dim,
            num_attention_heads=heads,
            kv_channels=head_dim,
            ffn_hidden_size=int(h["ffn_dim"]),
            layernorm_epsilon=float(h["eps"]),
            patch_size=tuple(h["patch_size"]),
            in_channels=int(h["in_channels"]),
            out_channels=int(h["out_channels"] or h["in_channels"]),
            text_dim=int(h["text_dim"]),
            freq_dim=int(h["freq_dim"]),
            cross_attn_norm=bool(h["cross_attn_norm"]),
            qk_norm=h["qk_norm"],
            rope_max_seq_len=int(h["rope_max_seq_len"]),
            image_dim=h["image_dim"],
            added_kv_proj_dim=h["added_kv_proj_dim"],
            pos_embed_seq_len=h["pos_embed_seq_len"],
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        kwargs.update({k: d[k] for k in own if k in d})
        names = {f.name for f in fields(cls)}
        bad = sorted(k for k in overrides if k not in names)
        if bad:
            raise UserError(f"unknown WanConfig fields: {bad}")
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def condition_channels(self) -> int:
        """Channels concatenated to the noisy latents of a channel-concatenated I2V checkpoint (Wan2.1-I2V,
        Wan2.2-I2V-A14B: a first-frame mask of ``vae_scale_factor_temporal`` channels and the image latents); 0
        for text-to-video and Wan2.2-TI2V (whose image replaces the first latent frame instead)."""
        return self.in_channels - self.out_channels

    @property
    def diffusers_pipeline(self) -> str:
        """The diffusers pipeline class of this transformer (what an exported two-expert root names)."""
        return "WanImageToVideoPipeline" if self.condition_channels else "WanPipeline"

    @property
    def experts(self) -> int:
        """Transformers of the policy: 2 with a ``boundary_ratio`` (high- and low-noise expert), else 1."""
        return 1 if self.boundary_ratio is None else 2

    def to_diffusers_config(self) -> dict[str, Any]:
        """The diffusers ``config.json`` hyper-parameters of this model (JSON-serialisable); a two-expert policy
        adds its ``boundary_ratio`` (the pipeline's key: each expert's own config.json is the rest)."""
        experts = {} if self.boundary_ratio is None else {"boundary_ratio": float(self.boundary_ratio)}
        return {**experts,
            "patch_size": list(self.patch_size),
            "num_attention_heads": self.num_attention_heads,
            "attention_head_dim": self.attention_head_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "text_dim": self.text_dim,
            "freq_dim": self.freq_dim,
            "ffn_dim": self.ffn_hidden_size,
            "num_layers": self.num_layers,
            "cross_attn_norm": self.cross_attn_norm,
            "qk_norm": self.qk_norm,
            "eps": self.layernorm_epsilon,
            "image_dim": self.image_dim,
            "added_kv_proj_dim": self.added_kv_proj_dim,
            "rope_max_seq_len": self.rope_max_seq_len,
            "pos_embed_seq_len": self.pos_embed_seq_len,
        }


def _preset(heads: int, ffn_dim: int, num_layers: int, channels: int = 16) -> dict[str, Any]:
    return {
        **_DIFFUSERS_DEFAULTS,
        "patch_size": [1, 2, 2],
        "num_attention_heads": heads,
        "attention_head_dim": 128,
        "in_channels": channels,
        "out_channels": channels,
        "ffn_dim": ffn_dim,
        "num_layers": num_layers,
    }


# diffusers config.json hyper-parameters of the released checkpoints (Wan-AI/*-Diffusers) and a CPU test size.
PRESETS: dict[str, dict[str, Any]] = {
    "wan2.1-1.3b": _preset(heads=12, ffn_dim=8960, num_layers=30),
    "wan2.1-14b": _preset(heads=40, ffn_dim=13824, num_layers=40),
    # TI2V-5B: same block design with 48 latent channels (Wan2.2 VAE); its per-token timesteps are supported.
    "wan2.2-ti2v-5b": _preset(heads=24, ffn_dim=14336, num_layers=30, channels=48),
    # T2V-A14B: two experts of Wan2.1-14B's shape, the high-noise one for t >= 875 (model_index.json).
    "wan2.2-t2v-a14b": {**_preset(heads=40, ffn_dim=13824, num_layers=40), "boundary_ratio": 0.875},
    "tiny": {
        **_DIFFUSERS_DEFAULTS,
        "patch_size": [1, 2, 2],
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 16,
        "freq_dim": 8,
        "ffn_dim": 32,
        "num_layers": 2,
        "rope_max_seq_len": 32,
    },
}
PRESETS["wan-tiny-a14b"] = {**PRESETS["tiny"], "boundary_ratio": 0.875}
"""The tiny architecture as two experts (CPU tests of Wan2.2-A14B's routing)."""
# Image-to-video: Wan2.1-I2V-14B (480P and 720P share it) concatenates a 4-channel first-frame mask and the 16
# image-latent channels to the noisy latents and reads 257 CLIP ViT-H/14 tokens; Wan2.2-I2V-A14B concatenates the
# same channels, has no CLIP tokens and two experts split at 0.9 (model_index.json).
PRESETS["wan2.1-i2v-14b"] = {**_preset(heads=40, ffn_dim=13824, num_layers=40), "in_channels": 36,
                             "image_dim": 1280, "added_kv_proj_dim": 5120}
PRESETS["wan2.2-i2v-a14b"] = {**_preset(heads=40, ffn_dim=13824, num_layers=40), "in_channels": 36,
                              "boundary_ratio": 0.9}
PRESETS["wan-tiny-i2v"] = {**PRESETS["tiny"], "in_channels": 12, "image_dim": 20, "added_kv_proj_dim": 24}
"""The tiny architecture with Wan2.1-I2V's conditioning (4 noisy + 4 mask + 4 image-latent channels, CLIP tokens)."""
PRESETS["wan-tiny-i2v-a14b"] = {**PRESETS["tiny"], "in_channels": 12, "boundary_ratio": 0.9}
"""The tiny architecture with Wan2.2-I2V-A14B's conditioning and two experts."""
