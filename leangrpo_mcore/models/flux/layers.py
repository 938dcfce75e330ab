"""FLUX.1 blocks: the double-stream (MMDiT) and single-stream blocks.

Parameter names follow diffusers' FluxTransformer2DModel, except where one GEMM replaces several: the fused q/k/v
projections of the shared joint attention (``common.mmdit``) and the single block's ``proj_out``, whose input
columns are grouped per head (see :class:`FluxSingleBlock`). The conversion plan (``convert.py``) maps the fused
layouts to diffusers' tensors.
"""

from __future__ import annotations

import torch

from leangrpo_mcore.models.common.context_parallel import SequenceShards
from leangrpo_mcore.models.common.embeddings import modulate
from leangrpo_mcore.models.common.mmdit import NORM_EPS, AdaLayerNormZero, FeedForward, JointAttention
from leangrpo_mcore.models.common.norms import LayerNorm
from leangrpo_mcore.models.common.tp import divide


class FluxDoubleBlock(torch.nn.Module):
    """Double-stream (MMDiT) block: separate adaLN / MLP for image and text, joint attention."""

    def __init__(self, config, *, backend) -> None:
        super().__init__()
        dim, hidden = config.hidden_size, config.ffn_hidden_size
        self.norm1 = AdaLayerNormZero(dim, 6, backend=backend, config=config)
        self.norm1_context = AdaLayerNormZero(dim, 6, backend=backend, config=config)
        self.attn = JointAttention(config, backend=backend, joint=True)
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
        self.attn = JointAttention(config, backend=backend, joint=False)
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
