"""FLUX.1 blocks: joint attention, adaLN-zero modulation, double- and single-stream blocks.

Parameter names follow diffusers' FluxTransformer2DModel, except where one GEMM replaces several: q, k and v
are one fused projection (``to_qkv`` for diffusers' ``to_q`` / ``to_k`` / ``to_v``, ``add_qkv_proj`` for the
text stream's ``add_{q,k,v}_proj``) whose output is interleaved per head, megatron-core's ``linear_qkv`` layout
(head 0: q, k, v; head 1: q, k, v; ...). Under tensor parallelism the attention heads and MLP hidden units are
split over the TP group (fused q/k/v, the MLP input and ``proj_mlp`` column-parallel; the output projections
row-parallel). The adaLN modulation linears are column-parallel too, their outputs all-gathered (as
megatron-core's DiT adaLN: ``ColumnParallelLinear(gather_output=True)``), so every rank holds the full shift /
scale / gate vectors but only its slice of the weights. The per-head q/k RMSNorm weights are replicated and
applied to this rank's heads. The conversion plan (``convert.py``) maps the fused layouts to diffusers' tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leangrpo_mcore.models.common.context_parallel import SequenceShards, attend
from leangrpo_mcore.models.common.embeddings import modulate
from leangrpo_mcore.models.common.lora import fuse_slots
from leangrpo_mcore.models.common.norms import LayerNorm, RMSNorm
from leangrpo_mcore.models.common.rope import apply_rotary
from leangrpo_mcore.models.common.tp import divide, gather_from_tp, tp_world_size

QK_NORM_EPS = 1e-6
NORM_EPS = 1e-6


class AdaLayerNormZero(torch.nn.Module):
    """LayerNorm (no affine) modulated by ``linear(silu(temb))`` split into ``chunks`` vectors.

    Returns the chunks in diffusers' order; the caller applies the first shift / scale pair. The linear is
    column-parallel and its output all-gathered (see the module doc).
    """

    def __init__(self, dim: int, chunks: int, *, backend, config) -> None:
        super().__init__()
        self.chunks = chunks
        self.linear = backend.column_parallel_linear(dim, chunks * dim, config=config)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(normed-and-modulated x, remaining chunks...): shift/scale of chunk 0/1 already applied."""
        emb = gather_from_tp(self.linear(F.silu(temb))).chunk(self.chunks, dim=1)
        return (modulate(self.norm(x), emb[0], emb[1]),) + emb[2:]


class AdaLayerNormContinuous(torch.nn.Module):
    """Output norm: LayerNorm (no affine) with ``scale, shift = linear(silu(temb))`` (scale first); the linear is
    column-parallel, its output all-gathered."""

    def __init__(self, dim: int, *, backend, config) -> None:
        super().__init__()
        self.linear = backend.column_parallel_linear(dim, 2 * dim, config=config)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """Normalise and modulate ``x`` (B, S, dim)."""
        scale, shift = gather_from_tp(self.linear(F.silu(temb).to(x.dtype))).chunk(2, dim=1)
        return modulate(self.norm(x), shift, scale)


class _GeluProjection(torch.nn.Module):
    """``gelu_tanh(proj(x))``: the first entry of diffusers' FeedForward ``net``."""

    def __init__(self, dim: int, hidden: int, *, backend, config) -> None:
        super().__init__()
        self.proj = backend.column_parallel_linear(dim, hidden, config=config, activation="gelu_tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project to this rank's hidden units and apply tanh-GELU (inside the linear, fused with its bias)."""
        return self.proj(x)


class FeedForward(torch.nn.Module):
    """tanh-GELU MLP ``net.2(gelu(net.0.proj(x)))``; column- then row-parallel (one all-reduce)."""

    def __init__(self, dim: int, hidden: int, *, backend, config) -> None:
        super().__init__()
        # net.1 stands where diffusers keeps a parameter-free Dropout, so the names line up.
        self.net = torch.nn.ModuleList([
            _GeluProjection(dim, hidden, backend=backend, config=config),
            torch.nn.Identity(),
            backend.row_parallel_linear(hidden, dim, config=config),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, dim) -> (B, S, dim)."""
        return self.net[2](self.net[0](x))


class FluxAttention(torch.nn.Module):
    """Multi-head attention with per-head q/k RMSNorm and RoPE; optionally joint with a text stream.

    ``joint=True`` (double-stream block) adds the text projection ``add_qkv_proj``, its norms and the output
    projections ``to_out.0`` / ``to_add_out``. ``joint=False`` (single-stream block) returns the pre-projection
    attention output of this rank's heads; the block owns the output projection. ``to_q`` / ``to_k`` / ``to_v``
    (and ``add_{q,k,v}_proj``) are the LoRA slots of the fused projections: adapters only, no weights.
    """

    def __init__(self, config, *, backend, joint: bool) -> None:
        super().__init__()
        dim, self.head_dim, dtype = config.hidden_size, config.attention_head_dim, config.params_dtype
        self.local_heads = divide(config.num_attention_heads, tp_world_size())
        self.joint = joint
        col = backend.column_parallel_linear
        self.to_qkv = col(dim, 3 * dim, config=config)
        self.to_q, self.to_k, self.to_v = fuse_slots(self.to_qkv, self.head_dim, 3)
        self.norm_q = RMSNorm(self.head_dim, QK_NORM_EPS, input_is_parallel=True, dtype=dtype)
        self.norm_k = RMSNorm(self.head_dim, QK_NORM_EPS, input_is_parallel=True, dtype=dtype)
        if joint:
            self.add_qkv_proj = col(dim, 3 * dim, config=config)
            self.add_q_proj, self.add_k_proj, self.add_v_proj = fuse_slots(self.add_qkv_proj, self.head_dim, 3)
            self.norm_added_q = RMSNorm(self.head_dim, QK_NORM_EPS, input_is_parallel=True, dtype=dtype)
            self.norm_added_k = RMSNorm(self.head_dim, QK_NORM_EPS, input_is_parallel=True, dtype=dtype)
            self.to_out = torch.nn.ModuleList([backend.row_parallel_linear(dim, dim, config=config)])
            self.to_add_out = backend.row_parallel_linear(dim, dim, config=config)
        self.core_attention = backend.core_attention(config=config)

    def _qkv(self, x: torch.Tensor, qkv_proj, q_norm, k_norm):
        # The fused output is (head, {q, k, v}, head_dim) per token: see the module doc.
        q, k, v = qkv_proj(x).unflatten(-1, (self.local_heads, 3, self.head_dim)).unbind(-2)
        return q_norm(q), k_norm(k), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: torch.Tensor | None = None, shards: SequenceShards | None = None):
        """Single: ``x`` (B, S, dim) -> (B, S, dim / tp). Joint: (x, context) -> (x_out, context_out).

        ``shards`` (context parallelism): the tokens here are this rank's piece of the joint sequence.
        """
        q, k, v = self._qkv(x, self.to_qkv, self.norm_q, self.norm_k)
        if self.joint:
            if context is None:
                raise ValueError("joint attention needs the text stream")
            cq, ck, cv = self._qkv(context, self.add_qkv_proj, self.norm_added_q, self.norm_added_k)
            # Text tokens come first in the joint sequence, matching the order of the RoPE ids.
            q, k, v = torch.cat([cq, q], dim=1), torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)
        out = attend(self.core_attention, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, shards)
        if not self.joint:
            return out
        text_len = context.shape[1]
        return self.to_out[0](out[:, text_len:]), self.to_add_out(out[:, :text_len])


class FluxDoubleBlock(torch.nn.Module):
    """Double-stream (MMDiT) block: separate adaLN / MLP for image and text, joint attention."""

    def __init__(self, config, *, backend) -> None:
        super().__init__()
        dim, hidden = config.hidden_size, config.ffn_hidden_size
        self.norm1 = AdaLayerNormZero(dim, 6, backend=backend, config=config)
        self.norm1_context = AdaLayerNormZero(dim, 6, backend=backend, config=config)
        self.attn = FluxAttention(config, backend=backend, joint=True)
        self.norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff = FeedForward(dim, hidden, backend=backend, config=config)
        self.norm2_context = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff_context = FeedForward(dim, hidden, backend=backend, config=config)

    def forward(self, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, shards: SequenceShards | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Image tokens ``x`` (B, S_img, dim), text tokens ``context`` (B, S_txt, dim) -> both updated."""
        x_norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)
        c_norm, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(context, temb)
        attn_x, attn_c = self.attn(x_norm, cos, sin, context=c_norm, shards=shards)
        x = x + gate_msa[:, None] * attn_x
        x = x + gate_mlp[:, None] * self.ff(modulate(self.norm2(x), shift_mlp, scale_mlp))
        context = context + c_gate_msa[:, None] * attn_c
        context = context + c_gate_mlp[:, None] * self.ff_context(
            modulate(self.norm2_context(context), c_shift_mlp, c_scale_mlp))
        return x, context


class FluxSingleBlock(torch.nn.Module):
    """Single-stream block on the joint sequence: attention and MLP in parallel from one adaLN norm.

    diffusers' ``proj_out`` consumes ``cat(attention, mlp)``. Ours consumes the same features grouped per head:
    for head ``h``, its attention channels, then the ``h``-th of ``num_heads`` equal runs of MLP units. Each TP
    rank holds whole heads and the matching contiguous run of MLP units (``proj_mlp`` is column-parallel), so
    its input columns are one contiguous slice of ours: a plain row-parallel linear (one GEMM, one
    all-reduce). The conversion plan maps the columns back to diffusers' order.
    """

    def __init__(self, config, *, backend) -> None:
        super().__init__()
        dim, mlp_hidden = config.hidden_size, config.ffn_hidden_size
        self.mlp_per_head = divide(mlp_hidden, config.num_attention_heads)
        self.norm = AdaLayerNormZero(dim, 3, backend=backend, config=config)
        self.proj_mlp = backend.column_parallel_linear(dim, mlp_hidden, config=config, activation="gelu_tanh")
        self.attn = FluxAttention(config, backend=backend, joint=False)
        self.proj_out = backend.row_parallel_linear(dim + mlp_hidden, dim, config=config)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                shards: SequenceShards | None = None) -> torch.Tensor:
        """Joint tokens (B, S_txt + S_img, dim) -> updated."""
        x_norm, gate = self.norm(x, temb)
        mlp = self.proj_mlp(x_norm)  # tanh-GELU applied by the linear
        heads = self.attn.local_heads
        attn = self.attn(x_norm, cos, sin, shards=shards).unflatten(-1, (heads, self.attn.head_dim))
        features = torch.cat([attn, mlp.unflatten(-1, (heads, self.mlp_per_head))], dim=-1).flatten(-2)
        return x + gate[:, None] * self.proj_out(features)
