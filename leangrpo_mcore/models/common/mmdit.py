"""The MMDiT pieces shared by FLUX, SD3 and Qwen-Image: adaLN modulation, the tanh-GELU MLP, joint attention.

Parameter names follow diffusers, except where one GEMM replaces several: q, k and v are one fused projection
(``to_qkv`` for diffusers' ``to_q`` / ``to_k`` / ``to_v``, ``add_qkv_proj`` for the text stream's
``add_{q,k,v}_proj``) whose output is interleaved per head, megatron-core's ``linear_qkv`` layout (head 0: q, k,
v; head 1: q, k, v; ...). Under tensor parallelism the attention heads and MLP hidden units are split over the TP
group (fused q/k/v and the MLP input column-parallel; the output projections row-parallel). The adaLN modulation
linears are column-parallel too, their outputs all-gathered (as megatron-core's DiT adaLN:
``ColumnParallelLinear(gather_output=True)``), so every rank holds the full shift / scale / gate vectors but only
its slice of the weights. The per-head q/k RMSNorm weights are replicated and applied to this rank's heads. The
families' conversion plans (``common.assembly.fused_qkv``) map the fused layouts to diffusers' tensors.
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


class JointAttention(torch.nn.Module):
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
                context: torch.Tensor | None = None, shards: SequenceShards | None = None,
                key_mask: torch.Tensor | None = None, text_output: bool = True):
        """Single: ``x`` (B, S, dim) -> (B, S, dim / tp). Joint: (x, context) -> (x_out, context_out).

        ``shards`` (context parallelism): the tokens here are this rank's piece of the joint sequence.
        ``key_mask`` (B, S_keys) bool, True = attend: which keys every query may see, in the order the kernel
        sees them (:func:`~leangrpo_mcore.models.common.context_parallel.attend`). ``text_output=False``: the
        caller reads no text output (context_out is None, ``to_add_out`` is not run).
        """
        q, k, v = self._qkv(x, self.to_qkv, self.norm_q, self.norm_k)
        if self.joint:
            if context is None:
                raise ValueError("joint attention needs the text stream")
            cq, ck, cv = self._qkv(context, self.add_qkv_proj, self.norm_added_q, self.norm_added_k)
            # Text tokens come first in the joint sequence, matching the order of the RoPE ids.
            q, k, v = torch.cat([cq, q], dim=1), torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)
        out = attend(self.core_attention, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, shards,
                     key_mask=key_mask)
        if not self.joint:
            return out
        text_len = context.shape[1]
        return self.to_out[0](out[:, text_len:]), self.to_add_out(out[:, :text_len]) if text_output else None
