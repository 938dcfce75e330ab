"""diffusers' ``SD3Transformer2DModel`` <-> :class:`SD3Transformer`, described once as an assembly plan.

Our parameters carry diffusers' names except the fused q/k/v projections (``to_qkv`` of ``attn`` and ``attn2``
from ``to_q`` / ``to_k`` / ``to_v``, ``add_qkv_proj`` from ``add_{q,k,v}_proj``, interleaved per head; see
``layers``). The patch convolution's kernel (D, C, p, p) is viewed as the linear weight (D, C·p·p). Nothing
changes a value, so a round trip is bit-exact.

diffusers also stores the fixed positional table ``pos_embed.pos_embed`` (a persistent buffer, a function of
the config only). We recompute it in the forward, so it is no parameter of ours: :func:`fixed_tensors` names it,
the import checks its shape and drops it, the export regenerates it exactly as diffusers builds it.
"""

from __future__ import annotations

import torch

from leangrpo_mcore.models.common.assembly import (Assembly, Piece, assemble, disassemble, fused_qkv, identity,
                                                   meta_shapes)
from leangrpo_mcore.models.sd3.config import SD3Config

PATCH_WEIGHT = "pos_embed.proj.weight"
POS_TABLE = "pos_embed.pos_embed"


def expected_shapes(config: SD3Config) -> dict[str, torch.Size]:
    """FULL shape of every parameter of the SD3 model described by ``config`` (built on the meta device)."""
    from leangrpo_mcore.models.sd3.model import SD3Transformer

    return meta_shapes(SD3Transformer, config)


def fixed_tensors(config: SD3Config) -> dict[str, tuple[int, ...]]:
    """Stored diffusers tensors that are functions of the config alone (not parameters of ours) and their shapes."""
    return {POS_TABLE: (1, config.pos_embed_max_size ** 2, config.hidden_size)}


def diffusers_plan(config: SD3Config) -> dict[str, Assembly]:
    """How each of our parameters is made of diffusers' tensors (see the module doc)."""
    plan = {}
    p = config.patch_size
    for name, shape in expected_shapes(config).items():
        shape = tuple(shape)
        fused = fused_qkv(name, shape, config.num_attention_heads)
        if fused is not None:
            plan[name] = fused
        elif name == PATCH_WEIGHT:
            plan[name] = Assembly((Piece(name, (shape[0], config.in_channels, p, p), shape),))
        else:
            plan[name] = identity(name, shape)
    return plan


def diffusers_to_mcore(state_dict: dict, config: SD3Config) -> dict:
    """Our state dict from a diffusers SD3Transformer2DModel state dict (the positional table dropped)."""
    fixed = fixed_tensors(config)
    for key, shape in fixed.items():
        if key in state_dict and tuple(state_dict[key].shape) != shape:
            raise ValueError(f"SD3 diffusers tensor {key} has shape {tuple(state_dict[key].shape)}, the config "
                             f"implies {shape}")
    rest = {k: v for k, v in state_dict.items() if k not in fixed}
    return assemble(rest, diffusers_plan(config), "SD3 diffusers")


def positional_table(config: SD3Config) -> torch.Tensor:
    """diffusers' stored ``pos_embed.pos_embed`` (1, max_size², hidden) float32 for ``config``."""
    from leangrpo_mcore.models.sd3.model import sincos_positions

    size = config.pos_embed_max_size
    return sincos_positions(config, size, size, crop=False).unsqueeze(0)


def mcore_to_diffusers(state_dict: dict, config: SD3Config) -> dict:
    """A diffusers SD3Transformer2DModel state dict from ours (no LoRA keys), with the positional table."""
    out = disassemble(state_dict, diffusers_plan(config), "SD3 policy")
    out[POS_TABLE] = positional_table(config)
    return out
