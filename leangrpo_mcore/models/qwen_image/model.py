"""The Qwen-Image transformer (diffusers' ``QwenImageTransformer2DModel``) on megatron-core layers.

``QwenImageTransformer(config, backend=...)`` builds every linear through the backend provider (local
megatron-core tensor-parallel layers or Transformer Engine); the forward takes diffusers' arguments and returns
the velocity of the packed latents. The text stream enters through an RMSNorm (``txt_norm``, over Qwen2.5-VL's
width) and ``txt_in``; the image tokens through ``img_in``; ``temb`` embeds the timestep alone (no pooled text).

Positions (diffusers' ``QwenEmbedRope`` with ``scale_rope``): an image token at frame f, row r, column c of an
h x w grid sits at (f, r - (h - h // 2), c - (w - w // 2)), the grid centred on 0; text token j sits at
m + j on all three axes, m = max(h // 2, w // 2), after the image. Each axis rotates its own channels
(``axes_dims_rope``), with angles computed in float32 as the reference does.

Padding of the text sequence (``encoder_hidden_states_mask``, True or 1 = a real token) is never attended to:
attention gets a key mask over [text, image], in the order its keys arrive under context parallelism.

Pipeline stages split the blocks; a boundary carries one tensor (B, 1 + S_txt + S_img, dim) in the model dtype,
``[temb, text tokens, image tokens]`` of this CP rank, as FLUX's; the RoPE tables and the key mask are rebuilt on
every stage from the forward's arguments.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from leangrpo_mcore.models.backends import get_backend
from leangrpo_mcore.models.common.activation_checkpoint import maybe_checkpoint
from leangrpo_mcore.models.common.context_parallel import SequenceShards, cp_group, gather_sequence, gathered_order
from leangrpo_mcore.models.common.embeddings import MLPEmbedder, timestep_embedding
from leangrpo_mcore.models.common.mmdit import AdaLayerNormContinuous
from leangrpo_mcore.models.common.norms import RMSNorm
from leangrpo_mcore.models.common.pipeline import PipelineStage, StageBlocks, check_boundary
from leangrpo_mcore.models.common.policy import PolicyMixin
from leangrpo_mcore.models.common.rope import multi_axis_rope_cos_sin
from leangrpo_mcore.models.qwen_image.config import LATENT_PACKING, VAE_SCALE_FACTOR, QwenImageConfig
from leangrpo_mcore.models.qwen_image.layers import QwenImageBlock

TIMESTEP_CHANNELS = 256
"""Sinusoidal features fed to the timestep embedder."""
TIMESTEP_SCALE = 1000.0
"""The model receives sigma in [0, 1] and embeds sigma * 1000 (diffusers' ``Timesteps(scale=1000)``)."""
TEXT_NORM_EPS = 1e-6


class TimestepEmbeddings(torch.nn.Module):
    """``timestep_embedder(sincos(1000 t))`` (diffusers' ``QwenTimestepProjEmbeddings``)."""

    def __init__(self, config: QwenImageConfig, *, backend) -> None:
        super().__init__()
        dim = config.hidden_size
        self.timestep_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim, dim, backend=backend, config=config)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B,) sigmas -> (B, dim) in ``dtype``."""
        features = timestep_embedding(timestep.to(dtype), TIMESTEP_CHANNELS, scale=TIMESTEP_SCALE)
        return self.timestep_embedder(features.to(dtype))


def image_grid(img_shapes, batch: int) -> tuple[int, int, int]:
    """(frames, rows, columns) of the token grid: diffusers' ``img_shapes`` (a list per sample of one
    (frames, rows, columns) each) or one such triple for the whole batch."""
    if isinstance(img_shapes, (tuple, list)) and len(img_shapes) == 3 and all(isinstance(v, int) for v in img_shapes):
        return tuple(int(v) for v in img_shapes)
    if not isinstance(img_shapes, (list, tuple)) or len(img_shapes) not in (1, batch):
        raise ValueError(f"img_shapes must be one (frames, rows, columns) or one list of them per sample, got "
                         f"{img_shapes!r}")
    grids = set()
    for sample in img_shapes:
        entries = [sample] if len(sample) == 3 and isinstance(sample[0], int) else list(sample)
        if len(entries) != 1:
            raise ValueError(f"one image per sample is supported, got img_shapes {img_shapes!r}")
        grids.add(tuple(int(v) for v in entries[0]))
    if len(grids) != 1:
        raise ValueError(f"every sample of a batch needs the same image grid, got {sorted(grids)}")
    return grids.pop()


def rope_ids(grid: tuple[int, int, int], text_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(text ids (S_txt, 3), image ids (F·h·w, 3)) float32 positions, as ``QwenEmbedRope(scale_rope=True)``."""
    frames, rows, cols = grid
    f = torch.arange(frames, dtype=torch.float32, device=device)
    r = torch.arange(rows, dtype=torch.float32, device=device) - (rows - rows // 2)
    c = torch.arange(cols, dtype=torch.float32, device=device) - (cols - cols // 2)
    image = torch.stack(torch.meshgrid(f, r, c, indexing="ij"), dim=-1).reshape(-1, 3)
    start = max(rows // 2, cols // 2)
    text = (start + torch.arange(text_len, dtype=torch.float32, device=device))[:, None].expand(text_len, 3)
    return text, image


class QwenImageTransformer(PolicyMixin, torch.nn.Module):
    """Qwen-Image velocity model: ``img_in`` / ``txt_norm`` + ``txt_in`` -> dual-stream blocks -> continuous
    adaLN -> ``proj_out`` (packed latents in, packed velocity out).

    Knows nothing of RL, FSDP or schedules: it exposes :meth:`blocks` for per-block wrapping and its sizes for
    planning. ``stage`` (default: the whole model) builds one pipeline stage under the whole model's names.
    """

    def __init__(self, config: QwenImageConfig, *, backend: str = "auto",
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        if not isinstance(config, QwenImageConfig):
            raise ValueError(f"QwenImageTransformer needs a QwenImageConfig, got {type(config).__name__}")
        stage = PipelineStage.whole(config.num_layers) if stage is None else stage
        if stage.total != config.num_layers:
            raise ValueError(f"pipeline stage splits {stage.total} blocks, the Qwen-Image model has "
                             f"{config.num_layers}")
        provider = get_backend(backend)
        self.config, self.backend_name, self.stage = config, provider.name, stage
        dim = config.hidden_size
        if stage.pre_process:
            self.time_text_embed = TimestepEmbeddings(config, backend=provider)
            self.txt_norm = RMSNorm(config.joint_attention_dim, TEXT_NORM_EPS, dtype=config.params_dtype)
            self.img_in = provider.replicated_linear(config.in_channels, dim, config=config)
            self.txt_in = provider.replicated_linear(config.joint_attention_dim, dim, config=config)
        last = config.num_layers - 1
        self.transformer_blocks = StageBlocks(
            (QwenImageBlock(config, backend=provider, text_output=i != last) for i in stage.blocks), first=stage.start)
        if stage.post_process:
            self.norm_out = AdaLayerNormContinuous(dim, backend=provider, config=config)
            out = config.patch_size * config.patch_size * config.output_channels
            self.proj_out = provider.replicated_linear(dim, out, config=config)
        self._follow_layers_to_device(provider)

    # ----------------------------------------------------------------- sizes and structure
    def blocks(self) -> list[torch.nn.Module]:
        """Every transformer block in execution order."""
        return list(self.transformer_blocks)

    def tokens_for(self, height: int, width: int, frames: int = 1) -> int:
        """Image tokens for a ``height`` x ``width`` pixel image (VAE /8, then 2x2 packing)."""
        if frames != 1:
            raise ValueError(f"Qwen-Image generates images: frames must be 1, got {frames}")
        side = VAE_SCALE_FACTOR * LATENT_PACKING
        if height % side or width % side:
            raise ValueError(f"height and width must be multiples of {side}, got {height}x{width}")
        return (height // side) * (width // side)

    # ----------------------------------------------------------------- forward
    def _check_inputs(self, hidden_states, encoder_hidden_states, mask, grid) -> None:
        c = self.config
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != c.in_channels:
            raise ValueError(f"Qwen-Image hidden_states must be (B, S, {c.in_channels}), got "
                             f"{tuple(hidden_states.shape)}")
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[-1] != c.joint_attention_dim:
            raise ValueError(f"Qwen-Image encoder_hidden_states must be (B, L, {c.joint_attention_dim}), got "
                             f"{tuple(encoder_hidden_states.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(encoder_hidden_states.shape[:2]):
            raise ValueError(f"encoder_hidden_states_mask must be (B, L) = {tuple(encoder_hidden_states.shape[:2])}, "
                             f"got {tuple(mask.shape)}")
        if grid[0] * grid[1] * grid[2] != hidden_states.shape[1]:
            raise ValueError(f"img_shapes {grid} holds {grid[0] * grid[1] * grid[2]} tokens, hidden_states has "
                             f"{hidden_states.shape[1]}")

    def _sequence(self, hidden_states, text, mask, grid):
        """This rank's image and text tokens, their RoPE rows, the attention key mask and the CP shards."""
        batch, image_len, text_len = hidden_states.shape[0], hidden_states.shape[1], text.shape[1]
        text_ids, image_ids = rope_ids(grid, text_len, hidden_states.device)
        axes, theta = self.config.axes_dims_rope, self.config.rope_theta
        cos, sin = multi_axis_rope_cos_sin(torch.cat([text_ids, image_ids]), axes, theta, angle_dtype=torch.float32)
        image_mask = None if mask is None else torch.ones(batch, image_len, dtype=torch.bool, device=mask.device)
        if cp_group() is None:
            key_mask = None if mask is None else torch.cat([mask, image_mask], dim=1)
            return hidden_states, text, cos, sin, key_mask, None, None
        # Context parallelism: this rank keeps its piece of the text and of the image tokens; the joint
        # sequence of every block is [its text, its image] (context_parallel's module doc).
        txt_shards, img_shards = SequenceShards.split(text_len), SequenceShards.split(image_len)
        rows = [(table.split([text_len, image_len])) for table in (cos, sin)]
        cos, sin = (torch.cat([txt_shards.shard(t, 0), img_shards.shard(i, 0)]) for t, i in rows)
        key_mask = None if mask is None else gathered_order([(mask, txt_shards), (image_mask, img_shards)], dim=1)
        return (img_shards.shard(hidden_states, 1), txt_shards.shard(text, 1), cos, sin, key_mask, img_shards,
                txt_shards.joint(img_shards))

    def boundary_shape(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                       **inputs) -> tuple[int, int, int]:
        """The shape of the boundary tensor a stage sends and receives for these forward arguments (only their
        shapes are read): (B, 1 + S_txt + S_img, dim), this CP rank's tokens."""
        text, image = encoder_hidden_states.shape[1], hidden_states.shape[1]
        if cp_group() is not None:
            text, image = SequenceShards.split(text).local, SequenceShards.split(image).local
        return hidden_states.shape[0], 1 + text + image, self.config.hidden_size

    def _received(self, text_len: int, image_len: int, batch: int):
        """(temb, text tokens, image tokens) out of the previous stage's boundary tensor."""
        received = self._take_stage_input(self.stage)
        check_boundary(received, (batch, 1 + text_len + image_len, self.config.hidden_size), self.stage)
        temb, context, x = received.split([1, text_len, image_len], dim=1)
        return temb.squeeze(1), context, x

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: Optional[torch.Tensor] = None, timestep: Optional[torch.Tensor] = None,
                img_shapes: Sequence | None = None) -> torch.Tensor:
        """Velocity (B, S_img, patch² · out_channels) of packed latents ``hidden_states`` (B, S_img, C).

        ``timestep`` (B,) are sigmas in [0, 1] (embedded after x1000); ``img_shapes`` the token grid (frames,
        rows, columns), diffusers' per-sample list or one triple; ``encoder_hidden_states_mask`` (B, L), nonzero
        for real text tokens (None: all are). Under context parallelism the inputs and the output are whole on
        every CP rank, the blocks see this rank's tokens only, and the output's gradient is summed over the CP
        group (``gather_sequence``). A pipeline stage other than the first reads its input from
        :meth:`set_input_tensor` and uses the arguments for positions, mask and sizes only; one other than the
        last returns the boundary tensor (module doc).
        """
        if timestep is None or img_shapes is None:
            raise ValueError("Qwen-Image needs timestep (B,) and img_shapes")
        grid = image_grid(img_shapes, hidden_states.shape[0])
        mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(torch.bool)
        self._check_inputs(hidden_states, encoder_hidden_states, mask, grid)
        tokens, text, cos, sin, key_mask, img_shards, joint_shards = self._sequence(
            hidden_states, encoder_hidden_states, mask, grid)
        if self.stage.pre_process:
            x = self.img_in(tokens)
            temb = self.time_text_embed(timestep, x.dtype)
            context = self.txt_in(self.txt_norm(text))
        else:
            temb, context, x = self._received(text.shape[1], tokens.shape[1], tokens.shape[0])
        checkpointing, fp8 = self.config.activation_checkpointing, bool(self.config.fp8)
        for block in self.transformer_blocks:
            x, context = maybe_checkpoint(block, x, context, temb, cos, sin, joint_shards, key_mask,
                                          enabled=checkpointing, fp8=fp8)
        if not self.stage.post_process:
            # temb rides as one extra token in the model dtype: a single boundary tensor (see the module doc).
            return torch.cat([temb.unsqueeze(1).to(x.dtype), context, x], dim=1)
        return gather_sequence(self.proj_out(self.norm_out(x, temb)), img_shards, 1)
