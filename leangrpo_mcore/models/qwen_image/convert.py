"""diffusers' ``QwenImageTransformer2DModel`` <-> :class:`QwenImageTransformer`, described once as an assembly plan.

Our parameters carry diffusers' names except the fused q/k/v projections of each block's joint attention
(``to_qkv`` from ``to_q`` / ``to_k`` / ``to_v``, ``add_qkv_proj`` from ``add_{q,k,v}_proj``, interleaved per
head; ``common.mmdit``). Nothing changes a value, so a round trip is bit-exact. diffusers keeps its RoPE tables
outside the state dict, so every stored tensor is a parameter of ours.
"""

from __future__ import annotations

import torch

from leangrpo_mcore.models.common.assembly import Assembly, assemble, disassemble, fused_qkv, identity, meta_shapes
from leangrpo_mcore.models.qwen_image.config import QwenImageConfig


def expected_shapes(config: QwenImageConfig) -> dict[str, torch.Size]:
    """FULL shape of every parameter of the Qwen-Image model described by ``config`` (built on the meta device)."""
    from leangrpo_mcore.models.qwen_image.model import QwenImageTransformer

    return meta_shapes(QwenImageTransformer, config)


def diffusers_plan(config: QwenImageConfig) -> dict[str, Assembly]:
    """How each of our parameters is made of diffusers' tensors (see the module doc)."""
    plan = {}
    for name, shape in expected_shapes(config).items():
        fused = fused_qkv(name, tuple(shape), config.num_attention_heads)
        plan[name] = fused if fused is not None else identity(name, tuple(shape))
    return plan


def diffusers_to_mcore(state_dict: dict, config: QwenImageConfig) -> dict:
    """Our state dict from a diffusers QwenImageTransformer2DModel state dict (views where nothing is fused)."""
    return assemble(state_dict, diffusers_plan(config), "Qwen-Image diffusers")


def mcore_to_diffusers(state_dict: dict, config: QwenImageConfig) -> dict:
    """A diffusers QwenImageTransformer2DModel state dict from ours (no LoRA keys)."""
    return disassemble(state_dict, diffusers_plan(config), "Qwen-Image policy")
