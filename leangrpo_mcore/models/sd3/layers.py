"""SD3 / SD3.5 blocks: MMDiT joint attention, the MMDiT-X second attention, adaLN-zero modulation.

Parameter names follow diffusers' ``SD3Transformer2DModel`` except where one GEMM replaces several, as in FLUX:
q, k and v are one fused projection (``to_qkv`` for ``to_q`` / ``to_k`` / ``to_v``, ``add_qkv_proj`` for the
text stream's ``add_{q,k,v}_proj``) whose output is interleaved per head (head 0: q, k, v; head 1: ...), so a
contiguous TP split gives each rank whole heads. The q/k/v projections and the MLP input are column-parallel,
the output projections row-parallel, the adaLN linears column-parallel with their output all-gathered (every
rank holds the whole modulation); the per-head q/k RMSNorm weights are replicated. The adaLN pieces shared
with FLUX (``AdaLayerNormZero``, ``AdaLayerNormContinuous``, ``FeedForward``) come from ``common.mmdit``.

SD3 has no RoPE: the joint sequence is [image, text] (diffusers' order), and attention does not depend on the
order of its keys, so context parallelism may hold [image_r, text_r] on rank r (``common.context_parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leangrpo_mcore.models.common.context_parallel import SequenceShards, attend
from leangrpo_mcore.models.common.embeddings import modulate
from leangrpo_mcore.models.common.lora import fuse_slots
from leangrpo_mcore.models.common.mmdit import AdaLayerNormContinuous, AdaLayerNormZero, FeedForward
from leangrpo_mcore.models.common.norms import LayerNorm, RMSNorm
from leangrpo_mcore.models.common.tp import divide, gather_from_tp, tp_world_size

QK_NORM_EPS = 1e-6
NORM_EPS = 1e-6


class AdaLayerNormZeroX(torch.nn.Module):
    """SD3.5's adaLN-zero with a second attention branch: ``linear(silu(temb))`` split into 9 vectors
    (shift, scale, gate of attention, of the MLP, of the second attention), one LayerNorm shared by both
    attention inputs. The linear is column-parallel, its output all-gathered."""

    def __init__(self, dim: int, *, backend, config) -> None:
        super().__init__()
        self.linear = backend.column_parallel_linear(dim, 9 * dim, config=config)
        self.norm = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x for attention, gate, shift_mlp, scale_mlp, gate_mlp, x for the second attention, its gate)."""
        emb = gather_from_tp(self.linear(F.silu(temb))).chunk(9, dim=1)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp, shift2, scale2, gate2 = emb
        normed = self.norm(x)
        return (modulate(normed, shift, scale), gate, shift_mlp, scale_mlp, gate_mlp,
                modulate(normed, shift2, scale2), gate2)


class SD3Attention(torch.nn.Module):
    """Multi-head attention with optional per-head q/k RMSNorm; joint with the text stream or image-only.

    ``joint=True`` adds ``add_qkv_proj`` (and its norms) for the text tokens and, unless ``context_pre_only``
    (the last block, whose text output nobody reads), the text output projection ``to_add_out``.
    ``to_q`` / ``to_k`` / ``to_v`` (``add_{q,k,v}_proj``) are the LoRA slots of the fused projections.
    """

    def __init__(self, config, *, backend, joint: bool, context_pre_only: bool = False) -> None:
        super().__init__()
        dim, self.head_dim, dtype = config.hidden_size, config.attention_head_dim, config.params_dtype
        self.local_heads = divide(config.num_attention_heads, tp_world_size())
        self.joint, self.context_pre_only = joint, context_pre_only
        col, qk_norm = backend.column_parallel_linear, config.qk_norm is not None
        self.to_qkv = col(dim, 3 * dim, config=config)
        self.to_q, self.to_k, self.to_v = fuse_slots(self.to_qkv, self.head_dim, 3)
        self.norm_q, self.norm_k = self._qk_norms(qk_norm, dtype)
        if joint:
            self.add_qkv_proj = col(dim, 3 * dim, config=config)
            self.add_q_proj, self.add_k_proj, self.add_v_proj = fuse_slots(self.add_qkv_proj, self.head_dim, 3)
            self.norm_added_q, self.norm_added_k = self._qk_norms(qk_norm, dtype)
            if not context_pre_only:
                self.to_add_out = backend.row_parallel_linear(dim, dim, config=config)
        self.to_out = torch.nn.ModuleList([backend.row_parallel_linear(dim, dim, config=config)])
        self.core_attention = backend.core_attention(config=config)

    def _qk_norms(self, enabled: bool, dtype: torch.dtype):
        if not enabled:
            return None, None
        return (RMSNorm(self.head_dim, QK_NORM_EPS, input_is_parallel=True, dtype=dtype),
                RMSNorm(self.head_dim, QK_NORM_EPS, input_is_parallel=True, dtype=dtype))

    def _qkv(self, x: torch.Tensor, qkv_proj, q_norm, k_norm):
        # The fused output is (head, {q, k, v}, head_dim) per token: see the module doc.
        q, k, v = qkv_proj(x).unflatten(-1, (self.local_heads, 3, self.head_dim)).unbind(-2)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                shards: SequenceShards | None = None):
        """Image-only: ``x`` (B, S, dim) -> (B, S, dim). Joint: (x, context) -> (x_out, context_out or None).

        ``shards`` (context parallelism): the split of the sequence attention runs over (the joint one when
        joint, the image tokens otherwise).
        """
        q, k, v = self._qkv(x, self.to_qkv, self.norm_q, self.norm_k)
        if self.joint:
            if context is None:
                raise ValueError("joint attention needs the text stream")
            cq, ck, cv = self._qkv(context, self.add_qkv_proj, self.norm_added_q, self.norm_added_k)
            q, k, v = torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
        out = attend(self.core_attention, q, k, v, shards)
        if not self.joint:
            return self.to_out[0](out)
        image_len = x.shape[1]
        text_out = None if self.context_pre_only else self.to_add_out(out[:, image_len:])
        return self.to_out[0](out[:, :image_len]), text_out


class SD3JointBlock(torch.nn.Module):
    """MMDiT block (diffusers' ``JointTransformerBlock``): adaLN-zero per stream, joint attention, MLPs.

    ``dual``: SD3.5's MMDiT-X block, which adds an image-only self-attention ``attn2`` fed by a second
    modulation of the same normalised image tokens. ``context_pre_only``: the last block, which reads the text
    stream (``norm1_context`` is a continuous adaLN) and returns no text.
    """

    def __init__(self, config, *, backend, dual: bool, context_pre_only: bool) -> None:
        super().__init__()
        dim, hidden = config.hidden_size, config.ffn_hidden_size
        self.dual, self.context_pre_only = dual, context_pre_only
        if dual:
            self.norm1 = AdaLayerNormZeroX(dim, backend=backend, config=config)
        else:
            self.norm1 = AdaLayerNormZero(dim, 6, backend=backend, config=config)
        if context_pre_only:
            self.norm1_context = AdaLayerNormContinuous(dim, backend=backend, config=config)
        else:
            self.norm1_context = AdaLayerNormZero(dim, 6, backend=backend, config=config)
        self.attn = SD3Attention(config, backend=backend, joint=True, context_pre_only=context_pre_only)
        if dual:
            self.attn2 = SD3Attention(config, backend=backend, joint=False)
        self.norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.ff = FeedForward(dim, hidden, backend=backend, config=config)
        if not context_pre_only:
            self.norm2_context = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
            self.ff_context = FeedForward(dim, hidden, backend=backend, config=config)

    def forward(self, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
                joint_shards: SequenceShards | None = None,
                image_shards: SequenceShards | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Image tokens ``x`` (B, S_img, dim), text tokens ``context`` (B, S_txt, dim) -> (x, context or None)."""
        if self.dual:
            x_norm, gate_msa, shift_mlp, scale_mlp, gate_mlp, x_norm2, gate_msa2 = self.norm1(x, temb)
        else:
            x_norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)
        if self.context_pre_only:
            c_norm = self.norm1_context(context, temb)
        else:
            c_norm, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(context, temb)
        attn_x, attn_c = self.attn(x_norm, c_norm, shards=joint_shards)
        x = x + gate_msa[:, None] * attn_x
        if self.dual:
            x = x + gate_msa2[:, None] * self.attn2(x_norm2, shards=image_shards)
        x = x + gate_mlp[:, None] * self.ff(modulate(self.norm2(x), shift_mlp, scale_mlp))
        if self.context_pre_only:
            return x, None
        context = context + c_gate_msa[:, None] * attn_c
        context = context + c_gate_mlp[:, None] * self.ff_context(
            modulate(self.norm2_context(context), c_shift_mlp, c_scale_mlp))
        return x, context
