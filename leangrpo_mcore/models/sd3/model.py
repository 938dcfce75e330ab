"""The Stable Diffusion 3 / 3.5 transformer (diffusers' ``SD3Transformer2DModel``) on megatron-core layers.

``SD3Transformer(config, backend=...)`` builds every linear through the backend provider (local megatron-core
tensor-parallel layers or Transformer Engine). The forward takes diffusers' arguments and returns the velocity.

The patch embedding is a stride-equals-kernel convolution, a linear map on flattened (C, p, p) patches; the
positional embedding is a fixed 2-D sin-cos table over a ``pos_embed_max_size`` square grid, cropped at its
centre to the token grid. diffusers stores that table as a buffer; it has no parameters, so it is recomputed
here for the tokens at hand (:func:`sincos_positions`) and regenerated on export (``convert``).

Pipeline stages (``common.pipeline``) split the joint blocks. A boundary carries one tensor
(B, 1 + S_txt + S_img, dim) in the model dtype, ``[temb, text tokens, image tokens]`` (tokens of this CP
rank), as FLUX's: temb (timestep + pooled text) is one token per sample, cheaper to send than to hold its two
embedders on every stage. The last block reads the text and returns none; it is always on the last stage.
"""

from __future__ import annotations

import torch

from leangrpo_mcore.models.backends import get_backend
from leangrpo_mcore.models.common.activation_checkpoint import maybe_checkpoint
from leangrpo_mcore.models.common.context_parallel import SequenceShards, cp_group, gather_sequence
from leangrpo_mcore.models.common.embeddings import MLPEmbedder, timestep_embedding
from leangrpo_mcore.models.common.mmdit import AdaLayerNormContinuous
from leangrpo_mcore.models.common.pipeline import PipelineStage, StageBlocks, check_boundary
from leangrpo_mcore.models.common.policy import PolicyMixin
from leangrpo_mcore.models.sd3.config import VAE_SCALE_FACTOR, SD3Config
from leangrpo_mcore.models.sd3.layers import SD3JointBlock

TIMESTEP_CHANNELS = 256
"""Sinusoidal features fed to the timestep embedder (the pipeline passes the scheduler timestep, 0..1000)."""


def _sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    # float64 frequencies and angles, [sin, cos]: diffusers' get_1d_sincos_pos_embed_from_grid.
    omega = torch.arange(dim // 2, dtype=torch.float64, device=positions.device)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    angles = torch.outer(positions.reshape(-1), omega)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def sincos_positions(config: SD3Config, rows: int, cols: int, *, crop: bool = True,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows * cols, hidden) float32 positional embedding of a ``rows`` x ``cols`` token grid, row-major.

    ``crop=True``: the centre crop of the ``pos_embed_max_size`` grid (what the model adds); ``crop=False``:
    ``rows`` = ``cols`` = ``pos_embed_max_size``, the whole table diffusers stores. Positions are
    ``index / (max_size / base_size)`` in float32; the first half of the channels encodes the column, the
    second the row (diffusers' ``get_2d_sincos_pos_embed``).
    """
    size, dim = config.pos_embed_max_size, config.hidden_size
    if rows > size or cols > size:
        raise ValueError(f"a {rows}x{cols} token grid exceeds pos_embed_max_size {size}")
    top, left = ((size - rows) // 2, (size - cols) // 2) if crop else (0, 0)
    scale = size / (config.sample_size // config.patch_size)
    row_pos = torch.arange(top, top + rows, dtype=torch.float32, device=device) / scale
    col_pos = torch.arange(left, left + cols, dtype=torch.float32, device=device) / scale
    by_col = _sincos_1d(dim // 2, col_pos)[None, :, :].expand(rows, cols, dim // 2)
    by_row = _sincos_1d(dim // 2, row_pos)[:, None, :].expand(rows, cols, dim // 2)
    return torch.cat([by_col, by_row], dim=-1).reshape(rows * cols, dim).float()


class CombinedTimestepTextProjEmbeddings(torch.nn.Module):
    """``temb = timestep_embedder(sincos(t)) + text_embedder(pooled)`` (diffusers' names)."""

    def __init__(self, config: SD3Config, *, backend) -> None:
        super().__init__()
        dim = config.hidden_size
        self.timestep_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim, dim, backend=backend, config=config)
        self.text_embedder = MLPEmbedder(config.pooled_projection_dim, dim, dim, backend=backend, config=config)

    def forward(self, timestep: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """(B,) timesteps on the 0..1000 scale, (B, pooled_dim) -> (B, dim)."""
        emb = self.timestep_embedder(timestep_embedding(timestep, TIMESTEP_CHANNELS).to(pooled.dtype))
        return emb + self.text_embedder(pooled)


class PatchEmbed(torch.nn.Module):
    """``proj``: diffusers' patch convolution as a linear on flattened (C, p, p) patches."""

    def __init__(self, config: SD3Config, *, backend) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = backend.replicated_linear(config.in_channels * p * p, config.hidden_size, config=config)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, S, C·p·p) patches and their (S, dim) float32 positions -> (B, S, dim) tokens."""
        x = self.proj(patches)
        return (x + positions.to(x.device)).to(x.dtype)


class SD3Transformer(PolicyMixin, torch.nn.Module):
    """SD3 / SD3.5 velocity model: patchify -> joint blocks -> continuous adaLN -> projection -> unpatchify.

    Knows nothing of RL, FSDP or schedules: it exposes :meth:`blocks` for per-block wrapping and its sizes for
    planning. ``stage`` (default: the whole model) builds one pipeline stage under the whole model's names.
    """

    def __init__(self, config: SD3Config, *, backend: str = "auto", stage: PipelineStage | None = None) -> None:
        super().__init__()
        if not isinstance(config, SD3Config):
            raise ValueError(f"SD3Transformer needs an SD3Config, got {type(config).__name__}")
        stage = PipelineStage.whole(config.num_layers) if stage is None else stage
        if stage.total != config.num_layers:
            raise ValueError(f"pipeline stage splits {stage.total} blocks, the SD3 model has {config.num_layers}")
        provider = get_backend(backend)
        self.config, self.backend_name, self.stage = config, provider.name, stage
        dim = config.hidden_size
        if stage.pre_process:
            self.pos_embed = PatchEmbed(config, backend=provider)
            self.time_text_embed = CombinedTimestepTextProjEmbeddings(config, backend=provider)
            self.context_embedder = provider.replicated_linear(config.joint_attention_dim,
                                                               config.caption_projection_dim, config=config)
        self.transformer_blocks = StageBlocks(
            (SD3JointBlock(config, backend=provider, dual=config.is_dual(i),
                           context_pre_only=config.is_context_pre_only(i)) for i in stage.blocks),
            first=stage.start)
        if stage.post_process:
            self.norm_out = AdaLayerNormContinuous(dim, backend=provider, config=config)
            p = config.patch_size
            self.proj_out = provider.replicated_linear(dim, p * p * config.output_channels, config=config)
        self._follow_layers_to_device(provider)

    # ----------------------------------------------------------------- sizes and structure
    def blocks(self) -> list[torch.nn.Module]:
        """Every transformer block in execution order."""
        return list(self.transformer_blocks)

    def tokens_for(self, height: int, width: int, frames: int = 1) -> int:
        """Image tokens for a ``height`` x ``width`` pixel image (VAE /8, then patches)."""
        if frames != 1:
            raise ValueError(f"SD3 generates images: frames must be 1, got {frames}")
        side = VAE_SCALE_FACTOR * self.config.patch_size
        if height % side or width % side:
            raise ValueError(f"height and width must be multiples of {side}, got {height}x{width}")
        return (height // side) * (width // side)

    # ----------------------------------------------------------------- forward
    def _grid(self, hidden_states: torch.Tensor) -> tuple[int, int]:
        c, p = self.config, self.config.patch_size
        if hidden_states.ndim != 4 or hidden_states.shape[1] != c.in_channels:
            raise ValueError(f"SD3 hidden_states must be (B, {c.in_channels}, H, W), got "
                             f"{tuple(hidden_states.shape)}")
        h, w = hidden_states.shape[2:]
        if h % p or w % p:
            raise ValueError(f"SD3 latent size {h}x{w} is not divisible by patch_size {p}")
        return h // p, w // p

    def _patchify(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        # (B, C, h*p, w*p) -> (B, h*w, C*p*p), features ordered (C, p, p) like the convolution kernel.
        (b, c), (h, w), p = x.shape[:2], grid, self.config.patch_size
        return x.reshape(b, c, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w, c * p * p)

    def _unpatchify(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        # diffusers: (B, h, w, p, q, C) -> (B, C, h*p, w*q).
        (h, w), p = grid, self.config.patch_size
        x = x.reshape(x.shape[0], h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(x.shape[0], x.shape[1], h * p, w * p)

    def _sequence(self, patches: torch.Tensor, positions: torch.Tensor, text: torch.Tensor):
        """This rank's patches, positions and text tokens, and the CP splits (image, joint; None without CP)."""
        if cp_group() is None:
            return patches, positions, text, None, None
        # Context parallelism: this rank keeps its piece of the image and of the text tokens; the joint
        # sequence of every block is [its image, its text] (context_parallel's module doc).
        img_shards = SequenceShards.split(patches.shape[1])
        txt_shards = SequenceShards.split(text.shape[1])
        return (img_shards.shard(patches, 1), img_shards.shard(positions, 0), txt_shards.shard(text, 1),
                img_shards, img_shards.joint(txt_shards))

    def _received(self, text_len: int, image_len: int, batch: int):
        """(temb, text tokens, image tokens) out of the previous stage's boundary tensor."""
        received = self._take_stage_input(self.stage)
        check_boundary(received, (batch, 1 + text_len + image_len, self.config.hidden_size), self.stage)
        temb, context, x = received.split([1, text_len, image_len], dim=1)
        return temb.squeeze(1), context, x

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """Velocity (B, C_out, H, W) for latents ``hidden_states`` (B, C, H, W) at ``timestep`` (B,) (the
        scheduler's 0..1000 scale, as StableDiffusion3Pipeline passes it), given the text sequence
        ``encoder_hidden_states`` (B, L, joint_attention_dim) and ``pooled_projections`` (B, pooled_dim).

        Under context parallelism the inputs and the output are whole on every CP rank, the blocks see this
        rank's tokens only, and the output's gradient is summed over the CP group (``gather_sequence``).
        A pipeline stage other than the first reads its input from :meth:`set_input_tensor` and uses the
        arguments for sizes only; one other than the last returns the boundary tensor (see the module doc).
        """
        grid = self._grid(hidden_states)
        c = self.config
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[-1] != c.joint_attention_dim:
            raise ValueError(f"SD3 encoder_hidden_states must be (B, L, {c.joint_attention_dim}), got "
                             f"{tuple(encoder_hidden_states.shape)}")
        positions = sincos_positions(c, *grid, device=hidden_states.device)
        patches, positions, text, img_shards, joint_shards = self._sequence(
            self._patchify(hidden_states, grid), positions, encoder_hidden_states)
        if self.stage.pre_process:
            x = self.pos_embed(patches, positions)
            temb = self.time_text_embed(timestep, pooled_projections)
            context = self.context_embedder(text)
        else:
            temb, context, x = self._received(text.shape[1], patches.shape[1], patches.shape[0])
        for block in self.transformer_blocks:
            x, context = maybe_checkpoint(block, x, context, temb, joint_shards, img_shards,
                                          enabled=c.activation_checkpointing, fp8=bool(c.fp8))
        if not self.stage.post_process:
            # temb rides as one extra token in the model dtype: a single boundary tensor (see the module doc).
            return torch.cat([temb.unsqueeze(1).to(x.dtype), context, x], dim=1)
        x = self.proj_out(self.norm_out(x, temb))
        return self._unpatchify(gather_sequence(x, img_shards, 1), grid)
