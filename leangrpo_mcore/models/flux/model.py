"""The FLUX.1 transformer (FluxTransformer2DModel architecture) on megatron-core layers.

Pipeline stages (``common.pipeline``) split the double-stream blocks followed by the single-stream blocks, one
sequence of ``num_layers`` blocks. A boundary carries one tensor (B, 1 + S_txt + S_img, dim) in the model dtype:
``[temb, text tokens, image tokens]``, the same at a boundary inside the double blocks (the two streams side by
side), at the double/single boundary and inside the single blocks (the joint sequence itself), so that every
boundary of a pipeline has one shape. The conditioning is split by what it costs:

- temb (timestep + guidance + pooled text embedding) is sent: it is one token per sample (6 KiB in bf16 at
  FLUX.1-dev, beside the 4608 tokens of a 1024 px image with 512 text tokens), while recomputing it would put
  the three embedders (32.3M parameters, 65 MB in bf16) on every stage and make their gradients a sum over
  stages;
- the RoPE tables are recomputed on every stage from ``img_ids`` / ``txt_ids``: they have no parameters and cost
  one outer product, while sending them would add 2 x (S_txt + S_img) x head_dim fp32 values per boundary.

``docs/models.md`` (Pipeline stages) has the numbers for every preset.
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
from leangrpo_mcore.models.common.rope import multi_axis_rope_cos_sin
from leangrpo_mcore.models.flux.config import LATENT_PACKING, VAE_SCALE_FACTOR, FluxConfig
from leangrpo_mcore.models.flux.layers import FluxDoubleBlock, FluxSingleBlock

TIMESTEP_CHANNELS = 256
"""Sinusoidal features fed to the timestep / guidance embedders."""
TIMESTEP_SCALE = 1000.0
"""The model receives sigma in [0, 1] and embeds sigma * 1000 (diffusers' FLUX convention)."""


class CombinedTimestepTextEmbedding(torch.nn.Module):
    """``temb = timestep_embedder(t) [+ guidance_embedder(g)] + text_embedder(pooled)``."""

    def __init__(self, config: FluxConfig, *, backend) -> None:
        super().__init__()
        dim = config.hidden_size
        kwargs = dict(backend=backend, config=config, act="silu")
        self.timestep_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim, dim, **kwargs)
        if config.guidance_embeds:
            self.guidance_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim, dim, **kwargs)
        self.text_embedder = MLPEmbedder(config.pooled_projection_dim, dim, dim, **kwargs)

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None,
                pooled: torch.Tensor) -> torch.Tensor:
        """(B,) scaled timesteps, optional (B,) scaled guidance, (B, pooled_dim) -> (B, dim)."""
        emb = self.timestep_embedder(timestep_embedding(timestep, TIMESTEP_CHANNELS).to(pooled.dtype))
        if guidance is not None:
            emb = emb + self.guidance_embedder(timestep_embedding(guidance, TIMESTEP_CHANNELS).to(pooled.dtype))
        return emb + self.text_embedder(pooled)


class FluxTransformer(PolicyMixin, torch.nn.Module):
    """FLUX.1 velocity model; ``forward`` takes diffusers' FluxTransformer2DModel arguments.

    Knows nothing of RL, FSDP or schedules: it exposes :meth:`blocks` for per-block wrapping and its
    sizes for planning. ``stage`` (default: the whole model) builds one pipeline stage: its blocks, the
    embedders on the first stage, the output norm and projection on the last, under the whole model's names.
    """

    def __init__(self, config: FluxConfig, *, backend: str = "auto", stage: PipelineStage | None = None) -> None:
        super().__init__()
        if not isinstance(config, FluxConfig):
            raise ValueError(f"FluxTransformer needs a FluxConfig, got {type(config).__name__}")
        stage = PipelineStage.whole(config.num_layers) if stage is None else stage
        if stage.total != config.num_layers:
            raise ValueError(f"pipeline stage splits {stage.total} blocks, the FLUX model has {config.num_layers}")
        provider = get_backend(backend)
        self.config, self.backend_name, self.stage = config, provider.name, stage
        dim = config.hidden_size
        if stage.pre_process:
            self.x_embedder = provider.replicated_linear(config.in_channels, dim, config=config)
            self.context_embedder = provider.replicated_linear(config.joint_attention_dim, dim, config=config)
            self.time_text_embed = CombinedTimestepTextEmbedding(config, backend=provider)
        # Double-stream blocks, then single-stream ones, counted as one sequence of blocks by the stage.
        double, single = config.num_double_layers, config.num_single_layers
        owned_double, owned_single = stage.owned(0, double), stage.owned(double, single)
        self.transformer_blocks = StageBlocks(
            (FluxDoubleBlock(config, backend=provider) for _ in owned_double), first=owned_double.start)
        self.single_transformer_blocks = StageBlocks(
            (FluxSingleBlock(config, backend=provider) for _ in owned_single), first=owned_single.start)
        if stage.post_process:
            self.norm_out = AdaLayerNormContinuous(dim, backend=provider, config=config)
            out = config.patch_size * config.patch_size * config.output_channels
            self.proj_out = provider.replicated_linear(dim, out, config=config)
        self._follow_layers_to_device(provider)

    # ----------------------------------------------------------------- sizes and structure
    def blocks(self) -> list[torch.nn.Module]:
        """Every transformer block in execution order (double-stream, then single-stream)."""
        return list(self.transformer_blocks) + list(self.single_transformer_blocks)

    def tokens_for(self, height: int, width: int, frames: int = 1) -> int:
        """Image tokens for a ``height`` x ``width`` pixel image (VAE /8, 2x2 packing, patch size)."""
        if frames != 1:
            raise ValueError(f"FLUX generates images: frames must be 1, got {frames}")
        side = VAE_SCALE_FACTOR * LATENT_PACKING * self.config.patch_size
        if height % side or width % side:
            raise ValueError(f"height and width must be multiples of {side}, got {height}x{width}")
        return (height // side) * (width // side)

    # ----------------------------------------------------------------- forward
    def _rope(self, img_ids: torch.Tensor, txt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Batched (B, S, 3) ids are a deprecated diffusers form; like diffusers, use the first row.
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        ids = torch.cat([txt_ids, img_ids], dim=0)
        return multi_axis_rope_cos_sin(ids, self.config.axes_dims_rope, self.config.rope_theta)

    def _check_inputs(self, hidden_states, encoder_hidden_states, guidance) -> None:
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != self.config.in_channels:
            raise ValueError(f"hidden_states must be (B, S, {self.config.in_channels}), got "
                             f"{tuple(hidden_states.shape)}")
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[-1] != self.config.joint_attention_dim:
            raise ValueError(f"encoder_hidden_states must be (B, S, {self.config.joint_attention_dim}), got "
                             f"{tuple(encoder_hidden_states.shape)}")
        if self.config.guidance_embeds and guidance is None:
            raise ValueError("this FLUX model embeds guidance: pass guidance (B,)")
        if not self.config.guidance_embeds and guidance is not None:
            raise ValueError("this FLUX model has no guidance embedding: guidance must be None")

    def _sequence(self, hidden_states, encoder_hidden_states, img_ids, txt_ids):
        """This rank's image and text tokens, their RoPE rows, and the CP shards (None without CP)."""
        cos, sin = self._rope(img_ids, txt_ids)
        if cp_group() is None:
            return hidden_states, encoder_hidden_states, cos, sin, None, None
        # Context parallelism: this rank keeps its piece of the text and of the image tokens; the joint
        # sequence of every block is [its text, its image] (context_parallel's module doc).
        txt_shards = SequenceShards.split(encoder_hidden_states.shape[1])
        img_shards = SequenceShards.split(hidden_states.shape[1])
        text_rows, img_rows = cos.split([txt_shards.total, img_shards.total])
        cos = torch.cat([txt_shards.shard(text_rows, 0), img_shards.shard(img_rows, 0)])
        text_rows, img_rows = sin.split([txt_shards.total, img_shards.total])
        sin = torch.cat([txt_shards.shard(text_rows, 0), img_shards.shard(img_rows, 0)])
        return (img_shards.shard(hidden_states, 1), txt_shards.shard(encoder_hidden_states, 1), cos, sin,
                img_shards, txt_shards.joint(img_shards))

    def _embed(self, tokens, text, pooled_projections, timestep, guidance):
        """(temb (B, dim), text tokens, image tokens) at the model width: the first stage's embedders."""
        x = self.x_embedder(tokens)
        t = timestep.to(x.dtype) * TIMESTEP_SCALE
        g = None if guidance is None else guidance.to(x.dtype) * TIMESTEP_SCALE
        return self.time_text_embed(t, g, pooled_projections), self.context_embedder(text), x

    def boundary_shape(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                       **inputs) -> tuple[int, int, int]:
        """The shape of the boundary tensor a stage sends and receives for these forward arguments (only their
        shapes are read): (B, 1 + S_txt + S_img, dim), this CP rank's tokens (:meth:`forward`). A pipelined call
        allocates its receive buffers in it once (megatron's ``tensor_shape``)."""
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
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity (B, S_img, out_channels * patch^2) for packed latents ``hidden_states`` (B, S_img, C).

        ``timestep`` and ``guidance`` are (B,) sigmas / guidance scales (embedded after x1000);
        ``img_ids`` (S_img, 3) and ``txt_ids`` (S_txt, 3) are RoPE positions. Under context parallelism the
        inputs and the output are whole on every CP rank, the blocks see this rank's tokens only, and the
        output's gradient is summed over the CP group (``gather_sequence``).

        Pipeline stages take the same arguments. A stage other than the first reads its input from
        :meth:`set_input_tensor` and uses the arguments only for positions and sizes; a stage other than the
        last returns the boundary tensor (B, 1 + S_txt + S_img, dim), tokens of this CP rank:
        ``[temb, text tokens, image tokens]`` (``docs/models.md``, Pipeline stages).
        """
        self._check_inputs(hidden_states, encoder_hidden_states, guidance)
        tokens, text, cos, sin, img_shards, joint_shards = self._sequence(hidden_states, encoder_hidden_states,
                                                                          img_ids, txt_ids)
        if self.stage.pre_process:
            temb, context, x = self._embed(tokens, text, pooled_projections, timestep, guidance)
        else:
            temb, context, x = self._received(text.shape[1], tokens.shape[1], tokens.shape[0])
        checkpointing, fp8 = self.config.activation_checkpointing, bool(self.config.fp8)
        for block in self.transformer_blocks:
            x, context = maybe_checkpoint(block, x, context, temb, cos, sin, joint_shards, enabled=checkpointing,
                                          fp8=fp8)
        text_len = context.shape[1]
        # Single-stream blocks run on the joint [text, image] sequence.
        joint = torch.cat([context, x], dim=1)
        for block in self.single_transformer_blocks:
            joint = maybe_checkpoint(block, joint, temb, cos, sin, joint_shards, enabled=checkpointing, fp8=fp8)
        if not self.stage.post_process:
            # temb rides as one extra token in the model dtype: a single boundary tensor (see the module doc).
            return torch.cat([temb.unsqueeze(1).to(joint.dtype), joint], dim=1)
        x = self.norm_out(joint[:, text_len:], temb)
        # a view of the linear's 2-D product; under FSDP2 the unit's output hook gives it storage of its own
        # (parallel/fsdp.py: _owned_output)
        return gather_sequence(self.proj_out(x), img_shards, 1)
