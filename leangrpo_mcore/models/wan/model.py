"""The Wan2.1 / Wan2.2 transformer (diffusers ``WanTransformer3DModel``, text- and image-to-video) on megatron-core.

``WanModel(config, backend=...)`` builds every linear through the backend provider (local megatron-core
tensor-parallel layers or Transformer Engine), so one set of parameter names serves both backends and the
converter. The forward takes diffusers' keyword arguments and returns the velocity tensor itself.

Pipeline stages (``common.pipeline``) split the blocks. Every block reads the hidden states, the 6-way timestep
modulation and the encoded text; the output norm reads temb. A boundary carries one tensor (B, S + 7T + L + I, D)
in the model dtype: ``[hidden states, temb, modulation, encoded text, encoded image tokens]``, T = 1 (one
timestep per sample) or S (per-token timesteps), tokens of this CP rank, I image tokens only for a checkpoint
with ``image_dim`` (Wan2.1-I2V: 257 CLIP tokens, embedded on the first stage). All three conditioning inputs are
sent, none recomputed: at
Wan2.1-14B the time embedder and ``time_proj`` hold 185M parameters and the text embedder 47M (370 MB and 94 MB
in bf16 that every stage would hold, with gradients summed over stages), while temb and the modulation are 7
tokens per sample and the text 512 tokens against the tens of thousands of video tokens that cross anyway.
Per-token timesteps make temb and the modulation 7 tokens per video token; ``docs/models.md`` (Pipeline
stages) has the numbers and why they are still sent. The RoPE tables have no parameters and are recomputed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from leangrpo_mcore.models.backends import get_backend
from leangrpo_mcore.models.common.activation_checkpoint import maybe_checkpoint
from leangrpo_mcore.models.common.context_parallel import SequenceShards, cp_group, gather_sequence
from leangrpo_mcore.models.common.norms import LayerNorm
from leangrpo_mcore.models.common.pipeline import PipelineStage, StageBlocks, check_boundary
from leangrpo_mcore.models.common.policy import PolicyMixin
from leangrpo_mcore.models.wan.config import WanConfig
from leangrpo_mcore.models.wan.layers import (
    WanBlock,
    WanConditionEmbedder,
    modulation_table,
    rope_tables,
    split_modulation,
)


class WanModel(PolicyMixin, nn.Module):
    """Wan T2V diffusion transformer: patchify -> N blocks -> modulated output norm -> projection -> unpatchify."""

    def __init__(self, config: WanConfig, *, backend: str = "auto", stage: Optional[PipelineStage] = None) -> None:
        super().__init__()
        if not isinstance(config, WanConfig):
            raise ValueError(f"WanModel needs a WanConfig, got {type(config).__name__}")
        stage = PipelineStage.whole(config.num_layers) if stage is None else stage
        if stage.total != config.num_layers:
            raise ValueError(f"pipeline stage splits {stage.total} blocks, the Wan model has {config.num_layers}")
        self.config, self.stage = config, stage
        provider = get_backend(backend)
        dim, patch_numel = config.hidden_size, math.prod(config.patch_size)
        if stage.pre_process:
            # A stride-equals-kernel Conv3d is a linear map on flattened (C, pt, ph, pw) patches.
            self.patch_embedding = provider.replicated_linear(config.in_channels * patch_numel, dim, config=config)
            self.condition_embedder = WanConditionEmbedder(config, provider)
        # Named ``layers`` (megatron style) so that ``blocks()`` can be the contract's accessor.
        self.layers = StageBlocks((WanBlock(config, provider) for _ in stage.blocks), first=stage.start)
        if stage.post_process:
            self.norm_out = LayerNorm(dim, config.layernorm_epsilon)
            self.proj_out = provider.replicated_linear(dim, config.out_channels * patch_numel, config=config)
            self.scale_shift_table = modulation_table(2, dim, config.params_dtype)
        self._follow_layers_to_device(provider)

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks in order (the units of per-block FSDP and activation checkpointing)."""
        return list(self.layers)

    def tokens_for(self, height: int, width: int, frames: int = 1) -> int:
        """Video tokens of a ``frames`` x ``height`` x ``width`` pixel video (VAE compression, then patches).

        Like the Wan pipelines, ``frames`` must be 1 + a multiple of the VAE's temporal factor and the sides
        multiples of the VAE's spatial factor times the patch.
        """
        c = self.config
        (pt, ph, pw), spatial, temporal = c.patch_size, c.vae_scale_factor_spatial, c.vae_scale_factor_temporal
        if min(height, width, frames) < 1 or (frames - 1) % temporal:
            raise ValueError(f"Wan frames must be 1 + a multiple of {temporal}, got {frames}")
        side_h, side_w = spatial * ph, spatial * pw
        if height % side_h or width % side_w:
            raise ValueError(f"Wan height/width must be multiples of {side_h}/{side_w}, got {height}x{width}")
        latent_frames = (frames - 1) // temporal + 1
        if latent_frames % pt:
            raise ValueError(f"{latent_frames} latent frames are not divisible by the temporal patch {pt}")
        return (latent_frames // pt) * (height // side_h) * (width // side_w)

    def _patch_grid(self, shape: torch.Size) -> tuple[int, int, int]:
        if len(shape) != 5 or shape[1] != self.config.in_channels:
            raise ValueError(
                f"Wan hidden_states must be (B, {self.config.in_channels}, F, H, W), got {tuple(shape)}"
            )
        dims = shape[2:]
        if any(d % p for d, p in zip(dims, self.config.patch_size)):
            raise ValueError(f"Wan latent size {tuple(dims)} is not divisible by patch_size {self.config.patch_size}")
        return tuple(d // p for d, p in zip(dims, self.config.patch_size))

    def _patchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        # (B, C, f*pt, h*ph, w*pw) -> (B, f*h*w, C*pt*ph*pw), features ordered (C, pt, ph, pw) like the kernel.
        (b, c), (f, h, w), (pt, ph, pw) = x.shape[:2], grid, self.config.patch_size
        x = x.reshape(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        return x.reshape(b, f * h * w, c * pt * ph * pw)

    def _unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        (f, h, w), (pt, ph, pw) = grid, self.config.patch_size
        x = x.reshape(x.shape[0], f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(x.shape[0], x.shape[1], f * pt, h * ph, w * pw)

    def boundary_shape(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                       encoder_hidden_states: torch.Tensor,
                       encoder_hidden_states_image: Optional[torch.Tensor] = None) -> tuple[int, int, int]:
        """The shape of the boundary tensor a stage sends and receives for these forward arguments (only their
        shapes are read): (B, S + 7·T + L + I, dim) of this CP rank's video tokens S, T = 1 or S per token, I image
        tokens (:meth:`_pack`). A pipelined call allocates its receive buffers in it once (megatron's
        ``tensor_shape``)."""
        batch, seq = hidden_states.shape[0], math.prod(self._patch_grid(hidden_states.shape))
        local = SequenceShards.split(seq).local if cp_group() is not None else seq
        rows = local if timestep.ndim == 2 else 1
        image = 0 if encoder_hidden_states_image is None else encoder_hidden_states_image.shape[1]
        return batch, local + 7 * rows + encoder_hidden_states.shape[1] + image, self.config.hidden_size

    def _check_timestep(self, timestep: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        if timestep.ndim == 0:
            return timestep.expand(batch)
        if timestep.shape == (batch,) or timestep.shape == (batch, seq):
            return timestep
        raise ValueError(
            f"Wan timestep must be (), ({batch},) or per-token ({batch}, {seq}), got {tuple(timestep.shape)}"
        )

    def _pack(self, h: torch.Tensor, temb: torch.Tensor, modulation: torch.Tensor,
              context: torch.Tensor, image: Optional[torch.Tensor]) -> torch.Tensor:
        """The boundary tensor (B, S + T + 6T + L + I, D): hidden states, temb, modulation, text, image tokens; T = 1,
        or S per token."""
        batch, dim = h.shape[0], h.shape[-1]
        parts = (h, temb.reshape(batch, -1, dim), modulation.reshape(batch, -1, dim), context) + (
            () if image is None else (image,))
        return torch.cat([part.to(h.dtype) for part in parts], dim=1)

    def _unpack(self, timestep: torch.Tensor, seq: int, text_len: int, image_len: int):
        """(hidden states, temb, modulation, text, image tokens or None) out of the previous stage's boundary."""
        received = self._take_stage_input(self.stage)
        batch, dim = timestep.shape[0], self.config.hidden_size
        per_token = timestep.shape[1:]  # () or (S,): the conditioning's token dimensions
        rows = 1 if timestep.ndim == 1 else timestep.shape[1]
        check_boundary(received, (batch, seq + 7 * rows + text_len + image_len, dim), self.stage)
        h, temb, modulation, context, image = received.split([seq, rows, 6 * rows, text_len, image_len], dim=1)
        return (h, temb.reshape(batch, *per_token, dim), modulation.reshape(batch, *per_token, 6, dim), context,
                image if image_len else None)

    def _check_image(self, image: Optional[torch.Tensor], batch: int) -> None:
        width = self.config.image_dim
        if width is None and image is not None:
            raise ValueError("this Wan checkpoint has no image_dim: it takes no encoder_hidden_states_image")
        if width is not None and (image is None or image.ndim != 3 or image.shape[0] != batch
                                  or image.shape[-1] != width):
            got = None if image is None else tuple(image.shape)
            raise ValueError(f"this Wan I2V checkpoint needs encoder_hidden_states_image ({batch}, I, {width}) "
                             f"(CLIP image tokens), got {got}")

    def forward(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Velocity (B, C_out, F, H, W) for latents ``hidden_states`` (B, C, F, H, W) at ``timestep`` (B,)
        (or per-token (B, S), as Wan2.2-TI2V) given text states ``encoder_hidden_states`` (B, L, text_dim) and,
        for a checkpoint with ``image_dim`` (Wan2.1-I2V), CLIP image tokens ``encoder_hidden_states_image``
        (B, I, image_dim). A channel-concatenated I2V checkpoint takes its mask and image latents as the
        channels of ``hidden_states`` after the noisy ones (C = ``in_channels``).

        Under context parallelism the inputs and the output are whole on every CP rank, the blocks see this rank's
        video tokens only, and the output's gradient is summed over the CP group (``gather_sequence``).

        Pipeline stages take the same arguments. A stage other than the first reads its input from
        :meth:`set_input_tensor` and uses the arguments only for positions and sizes; a stage other than the last
        returns the boundary tensor (see the module doc).
        """
        grid = self._patch_grid(hidden_states.shape)
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[-1] != self.config.text_dim:
            shape = tuple(encoder_hidden_states.shape)
            raise ValueError(f"Wan encoder_hidden_states must be (B, L, {self.config.text_dim}), got {shape}")
        batch, seq = hidden_states.shape[0], math.prod(grid)
        self._check_image(encoder_hidden_states_image, batch)
        timestep = self._check_timestep(timestep, batch, seq)
        rope = rope_tables(self.config, grid, hidden_states.device)
        tokens = self._patchify(hidden_states, grid)
        shards = None
        if cp_group() is not None:
            # Context parallelism: this rank keeps its piece of the video tokens (and of their RoPE rows and
            # per-token timesteps); the text stays whole on every rank.
            shards = SequenceShards.split(seq)
            tokens, rope = shards.shard(tokens, 1), tuple(shards.shard(table, 0) for table in rope)
            timestep = shards.shard(timestep, 1) if timestep.ndim == 2 else timestep
        if self.stage.pre_process:
            h = self.patch_embedding(tokens)
            temb, modulation, context, image = self.condition_embedder(timestep, encoder_hidden_states,
                                                                       encoder_hidden_states_image)
        else:
            image_len = 0 if encoder_hidden_states_image is None else encoder_hidden_states_image.shape[1]
            h, temb, modulation, context, image = self._unpack(timestep, tokens.shape[1],
                                                               encoder_hidden_states.shape[1], image_len)
        for block in self.layers:
            h = maybe_checkpoint(block, h, context, modulation, rope, shards, image,
                                 enabled=self.config.activation_checkpointing, fp8=bool(self.config.fp8))
        if not self.stage.post_process:
            return self._pack(h, temb, modulation, context, image)
        shift, scale = split_modulation(self.scale_shift_table, temb.unsqueeze(-2))
        h = (self.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        return self._unpatchify(gather_sequence(self.proj_out(h), shards, 1), grid)
