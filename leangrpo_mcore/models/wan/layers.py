"""The Wan-specific building blocks: embeddings, 3-D RoPE, attention, feed-forward and the transformer block.

Tensor parallelism lives inside the layers: q/k/v, the FFN's first projection and the text embedder's first
projection are column-parallel (heads / hidden units / features split over the TP group), their partners are
row-parallel (output all-reduced), so the residual stream, the modulation vectors and every embedding stay
replicated and identical on all TP ranks. The timestep modulation projection ``time_proj`` is column-parallel
with its output all-gathered (megatron-core's DiT adaLN). Wan normalises q and k with one RMSNorm over ALL heads;
under TP its statistic is all-reduced over the group (``TPRMSNorm``), which keeps TP=N equal to TP=1.

Projections that read the same input are one GEMM whose output is interleaved per head (megatron-core's
``linear_qkv`` layout): self-attention's ``to_qkv`` (head 0: q, k, v; head 1: ...) and cross-attention's
``to_kv`` over the text (``to_q`` reads the video tokens and stays separate). diffusers' ``to_q`` / ``to_k`` /
``to_v`` names remain as LoRA slots of the fused projections (adapters only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from leangrpo_mcore.models.backends import BackendProvider
from leangrpo_mcore.models.common.context_parallel import SequenceShards, attend
from leangrpo_mcore.models.common.embeddings import MLPEmbedder, timestep_embedding
from leangrpo_mcore.models.common.init import normal_init, set_init
from leangrpo_mcore.models.common.lora import fuse_slots
from leangrpo_mcore.models.common.norms import LayerNorm, TPRMSNorm
from leangrpo_mcore.models.common.rope import apply_rotary, multi_axis_rope_cos_sin
from leangrpo_mcore.models.common.tp import divide, gather_from_tp, tp_world_size
from leangrpo_mcore.models.wan.config import WanConfig

RopeTables = tuple[torch.Tensor, torch.Tensor]

# RoPE base of the released Wan models (fixed in the reference implementation, not a config key).
ROPE_THETA = 10000.0


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of a head given to the (frame, height, width) axes of the 3-D RoPE."""
    h_dim = w_dim = 2 * (head_dim // 6)
    return head_dim - h_dim - w_dim, h_dim, w_dim


def rope_tables(config: WanConfig, grid: tuple[int, int, int], device: torch.device) -> RopeTables:
    """cos/sin (S, head_dim) fp32 of the 3-D RoPE for a (frames, height, width) patch grid, S = f*h*w.

    Computed per forward rather than stored as buffers, so that casting the model to bf16 never rounds them.
    """
    if max(grid) > config.rope_max_seq_len:
        raise ValueError(f"Wan patch grid {grid} exceeds rope_max_seq_len {config.rope_max_seq_len}")
    axes = [torch.arange(n, device=device) for n in grid]
    ids = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    return multi_axis_rope_cos_sin(ids, rope_axis_dims(config.attention_head_dim), ROPE_THETA)


class WanTextEmbedder(nn.Module):
    """Text hidden states -> linear (column) -> tanh-GELU -> linear (row): (B, L, text_dim) -> (B, L, hidden)."""

    def __init__(self, config: WanConfig, backend: BackendProvider) -> None:
        super().__init__()
        self.linear_1 = backend.column_parallel_linear(config.text_dim, config.hidden_size, config=config,
                                                       activation="gelu_tanh")
        self.linear_2 = backend.row_parallel_linear(config.hidden_size, config.hidden_size, config=config)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        """Project the text encoder's states to the model width (the GELU is applied by ``linear_1``)."""
        return self.linear_2(self.linear_1(text))


class WanImageEmbedder(nn.Module):
    """Wan2.1-I2V's CLIP image tokens -> the model width: fp32 LayerNorm, linear, exact GELU, linear, fp32
    LayerNorm (diffusers' ``WanImageEmbedding``, eps 1e-5). Replicated: the 257 image tokens are few."""

    def __init__(self, config: WanConfig, backend: BackendProvider) -> None:
        super().__init__()
        width, dim, dtype = config.image_dim, config.hidden_size, config.params_dtype
        self.norm1 = LayerNorm(width, eps=1e-5, elementwise_affine=True, dtype=dtype)
        self.fc1 = backend.replicated_linear(width, width, config=config)
        self.fc2 = backend.replicated_linear(width, dim, config=config)
        self.norm2 = LayerNorm(dim, eps=1e-5, elementwise_affine=True, dtype=dtype)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """(B, I, image_dim) -> (B, I, D)."""
        return self.norm2(self.fc2(F.gelu(self.fc1(self.norm1(image)))))


class WanConditionEmbedder(nn.Module):
    """Time embedding, its 6-way modulation projection, the text embedding and (I2V) the image embedding."""

    def __init__(self, config: WanConfig, backend: BackendProvider) -> None:
        super().__init__()
        self.freq_dim = config.freq_dim
        self.time_embedder = MLPEmbedder(
            config.freq_dim, config.hidden_size, config.hidden_size, backend=backend, config=config, act="silu"
        )
        self.time_proj = backend.column_parallel_linear(config.hidden_size, 6 * config.hidden_size, config=config)
        self.text_embedder = WanTextEmbedder(config, backend)
        if config.image_dim is not None:
            self.image_embedder = WanImageEmbedder(config, backend)

    def forward(
        self, timestep: torch.Tensor, text: torch.Tensor, image: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``timestep`` (B,) or per-token (B, S) -> temb (B[, S], D), modulation (B[, S], 6, D), text (B, L, D),
        image tokens (B, I, D) (None without)."""
        sinusoid = timestep_embedding(timestep.flatten(), self.freq_dim).to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(sinusoid).unflatten(0, timestep.shape).type_as(text)
        modulation = gather_from_tp(self.time_proj(F.silu(temb))).unflatten(-1, (6, -1))
        embedded = None if image is None else self.image_embedder(image).type_as(text)
        return temb, modulation, self.text_embedder(text), embedded


class WanAttention(nn.Module):
    """Multi-head attention with q/k RMSNorm over all heads; self-attention (with RoPE, fused ``to_qkv``) or
    cross-attention (``cross=True``: ``to_q`` on the video tokens, fused ``to_kv`` on the text). With image tokens
    (Wan2.1-I2V) the cross-attention's queries also attend to them through their own fused key/value projection
    ``to_added_kv`` (diffusers' ``add_k_proj`` / ``add_v_proj``, the keys RMS-normalised by ``norm_added_k``), and
    the two attention outputs are summed before ``to_out``."""

    def __init__(self, config: WanConfig, backend: BackendProvider, *, cross: bool) -> None:
        super().__init__()
        dim = config.hidden_size
        self.heads_local = divide(config.num_attention_heads, tp_world_size())
        self.head_dim = config.attention_head_dim
        self.cross = cross
        col = backend.column_parallel_linear
        if cross:
            self.to_q = col(dim, dim, config=config)
            self.to_kv = col(dim, 2 * dim, config=config)
            self.to_k, self.to_v = fuse_slots(self.to_kv, self.head_dim, 2)
            if config.added_kv_proj_dim is not None:
                self.to_added_kv = col(config.added_kv_proj_dim, 2 * dim, config=config)
                self.add_k_proj, self.add_v_proj = fuse_slots(self.to_added_kv, self.head_dim, 2)
                self.norm_added_k = TPRMSNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        else:
            self.to_qkv = col(dim, 3 * dim, config=config)
            self.to_q, self.to_k, self.to_v = fuse_slots(self.to_qkv, self.head_dim, 3)
        self.norm_q = TPRMSNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        self.norm_k = TPRMSNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        self.core_attention = backend.core_attention(config=config)
        self.to_out = backend.row_parallel_linear(dim, dim, config=config)

    def forward(
        self, x: torch.Tensor, context: Optional[torch.Tensor] = None, rope: Optional[RopeTables] = None,
        shards: Optional[SequenceShards] = None, image: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``x`` (B, S, D) attends to itself or (cross-attention) to ``context`` (B, L, D) and the embedded image
        tokens ``image`` (B, I, D) where the checkpoint has them; returns (B, S, D).

        ``shards`` (context-parallel self-attention): ``x`` is this rank's piece of the video tokens.
        """
        if self.cross != (context is not None):
            raise ValueError("cross-attention needs the text context; self-attention takes none")
        if (image is not None) != hasattr(self, "to_added_kv"):
            raise ValueError("image tokens go with a checkpoint that has image_dim (and only there)")
        heads = (self.heads_local, self.head_dim)
        # The fused outputs are (head, {q, k, v} or {k, v}, head_dim) per token: see the module doc. The norms
        # read the strided per-head views as they are.
        if self.cross:
            q = self.to_q(x).unflatten(-1, heads)
            k, v = self.to_kv(context).unflatten(-1, (self.heads_local, 2, self.head_dim)).unbind(-2)
        else:
            q, k, v = self.to_qkv(x).unflatten(-1, (self.heads_local, 3, self.head_dim)).unbind(-2)
        q, k = self.norm_q(q, heads=True), self.norm_k(k, heads=True)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = attend(self.core_attention, q, k, v, shards).type_as(q)
        if image is not None:  # local queries against every image token: no exchange under CP
            k_img, v_img = self.to_added_kv(image).unflatten(-1, (self.heads_local, 2, self.head_dim)).unbind(-2)
            out = out + self.core_attention(q, self.norm_added_k(k_img, heads=True), v_img).type_as(q)
        return self.to_out(out)


class WanFeedForward(nn.Module):
    """fc1 (column) -> tanh-GELU -> fc2 (row)."""

    def __init__(self, config: WanConfig, backend: BackendProvider) -> None:
        super().__init__()
        self.fc1 = backend.column_parallel_linear(config.hidden_size, config.ffn_hidden_size, config=config,
                                                  activation="gelu_tanh")
        self.fc2 = backend.row_parallel_linear(config.ffn_hidden_size, config.hidden_size, config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D); the GELU is applied by ``fc1``."""
        return self.fc2(self.fc1(x))


def modulation_table(n: int, dim: int, dtype: torch.dtype) -> nn.Parameter:
    """A learned (1, n, dim) shift/scale/gate table, initialised N(0, 1/dim) like the reference."""
    table = nn.Parameter((torch.randn(1, n, dim) / dim**0.5).to(dtype))
    set_init(table, normal_init(dim**-0.5))
    return table


def split_modulation(table: torch.Tensor, modulation: torch.Tensor) -> list[torch.Tensor]:
    """Learned table (1, n, D) + time modulation (B, n, D) or per-token (B, S, n, D), in fp32, split into n
    tensors that broadcast against (B, S, D): each (B, 1, D) or (B, S, D)."""
    mod = table.float() + modulation.float()
    if mod.ndim == 3:
        return [m.unsqueeze(1) for m in mod.unbind(1)]
    return list(mod.unbind(2))


class WanBlock(nn.Module):
    """adaLN-modulated self-attention, plain cross-attention to the text, adaLN-modulated FFN."""

    def __init__(self, config: WanConfig, backend: BackendProvider) -> None:
        super().__init__()
        dim = config.hidden_size
        self.attn1 = WanAttention(config, backend, cross=False)
        self.attn2 = WanAttention(config, backend, cross=True)
        eps, dtype = config.layernorm_epsilon, config.params_dtype
        self.norm1 = LayerNorm(dim, eps)
        self.norm2 = nn.Identity()
        if config.cross_attn_norm:
            self.norm2 = LayerNorm(dim, eps, elementwise_affine=True, dtype=dtype)
        self.norm3 = LayerNorm(dim, eps)
        self.ffn = WanFeedForward(config, backend)
        self.scale_shift_table = modulation_table(6, dim, dtype)

    def forward(
        self, hidden_states: torch.Tensor, context: torch.Tensor, modulation: torch.Tensor, rope: RopeTables,
        shards: Optional[SequenceShards] = None, image: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``hidden_states`` (B, S, D), ``context`` (B, L, D), ``modulation`` (B[, S], 6, D) -> (B, S, D);
        ``image`` (B, I, D): the embedded image tokens of Wan2.1-I2V, attended to by the cross-attention.

        Under context parallelism (``shards``) the video tokens are this rank's piece; the text and image tokens
        stay whole, so cross-attention needs no exchange.
        """
        shift, scale, gate, c_shift, c_scale, c_gate = split_modulation(self.scale_shift_table, modulation)
        h = hidden_states
        # Residual adds and modulations run in fp32, the sublayers in the model dtype (as the reference).
        x = (self.norm1(h.float()) * (1 + scale) + shift).type_as(h)
        h = (h.float() + self.attn1(x, rope=rope, shards=shards) * gate).type_as(h)
        h = h + self.attn2(self.norm2(h.float()).type_as(h), context=context, image=image)
        x = (self.norm3(h.float()) * (1 + c_scale) + c_shift).type_as(h)
        return (h.float() + self.ffn(x).float() * c_gate).type_as(h)
