"""The Qwen-Image block: diffusers' ``QwenImageTransformerBlock`` on megatron-core layers.

A dual-stream (MMDiT) block like FLUX's double-stream one, built from the shared pieces of ``common.mmdit``: the
image and the text stream each have their own adaLN modulation ``img_mod`` / ``txt_mod`` (``SiLU`` then one
linear to six vectors: shift, scale, gate before attention, then before the MLP), LayerNorms without affine
weights (``img_norm1``, ``img_norm2``, ``txt_norm1``, ``txt_norm2``) and tanh-GELU MLPs (``img_mlp``,
``txt_mlp``); one joint attention (per-head q/k RMSNorm, RoPE, the [text, image] sequence) updates both. The
modulation linears are column-parallel with their output all-gathered, the attention and MLPs split heads and
hidden units over TP (``common.mmdit``). Text tokens that are padding are never attended to (``key_mask``).

The last block's text output feeds nothing (the output layer reads the image tokens): that block keeps
diffusers' text MLP and text attention projection as parameters (checkpoints hold them) but does not run them
(``text_output=False``), work diffusers computes and discards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leangrpo_mcore.models.common.context_parallel import SequenceShards
from leangrpo_mcore.models.common.embeddings import modulate
from leangrpo_mcore.models.common.mmdit import NORM_EPS, FeedForward, JointAttention
from leangrpo_mcore.models.common.norms import LayerNorm
from leangrpo_mcore.models.common.tp import gather_from_tp


class Modulation(torch.nn.ModuleList):
    """diffusers' ``nn.Sequential(SiLU(), Linear(dim, 6 dim))``: entry 1 is the (column-parallel) linear."""

    def __init__(self, dim: int, *, backend, config) -> None:
        super().__init__([torch.nn.SiLU(), backend.column_parallel_linear(dim, 6 * dim, config=config)])

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, dim) -> six (B, dim) vectors: shift, scale, gate of the attention input, then of the MLP input."""
        return gather_from_tp(self[1](F.silu(temb))).chunk(6, dim=1)


class QwenImageBlock(torch.nn.Module):
    """Dual-stream block: per-stream modulation, norms and MLPs around one joint attention; ``text_output=False``
    (the last block) returns the text stream as it came in, its update unread (module doc)."""

    def __init__(self, config, *, backend, text_output: bool = True) -> None:
        super().__init__()
        dim, hidden = config.hidden_size, config.ffn_hidden_size
        self.text_output = text_output
        self.img_mod = Modulation(dim, backend=backend, config=config)
        self.img_norm1 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.attn = JointAttention(config, backend=backend, joint=True)
        self.img_norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.img_mlp = FeedForward(dim, hidden, backend=backend, config=config)
        self.txt_mod = Modulation(dim, backend=backend, config=config)
        self.txt_norm1 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.txt_norm2 = LayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.txt_mlp = FeedForward(dim, hidden, backend=backend, config=config)

    def forward(self, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, shards: SequenceShards | None = None,
                key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Image tokens ``x`` (B, S_img, dim), text tokens ``context`` (B, S_txt, dim) -> both updated.

        ``cos`` / ``sin``: RoPE rows of the [text, image] tokens held here; ``key_mask`` (B, keys) True = attend,
        in the order attention sees the keys (None: every key).
        """
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.img_mod(temb)
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.txt_mod(temb)
        attn_x, attn_c = self.attn(modulate(self.img_norm1(x), shift, scale), cos, sin,
                                   context=modulate(self.txt_norm1(context), c_shift, c_scale), shards=shards,
                                   key_mask=key_mask, text_output=self.text_output)
        x = x + gate[:, None] * attn_x
        x = x + gate_mlp[:, None] * self.img_mlp(modulate(self.img_norm2(x), shift_mlp, scale_mlp))
        if not self.text_output:
            return x, context
        context = context + c_gate[:, None] * attn_c
        context = context + c_gate_mlp[:, None] * self.txt_mlp(
            modulate(self.txt_norm2(context), c_shift_mlp, c_scale_mlp))
        return x, context
