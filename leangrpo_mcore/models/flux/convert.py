"""diffusers FluxTransformer2DModel <-> our FLUX parameters, described once as an assembly plan.

Most of our parameters are the same-named diffusers tensor as it is
(:func:`~leangrpo_mcore.models.common.assembly.identity`). Two layouts differ, both interleaved per attention head
so that a contiguous TP split gives each rank whole heads (see ``layers``):

- the fused q/k/v projections ``to_qkv`` / ``add_qkv_proj`` (weight and bias): rows of diffusers' ``to_q``,
  ``to_k``, ``to_v`` (``add_{q,k,v}_proj``), head by head;
- the single-block ``proj_out.weight``: for each head, its attention columns, then its run of MLP columns.

Both directions derive from the plan after a strict check of names and shapes against the config; a round trip
is bit-exact (slices and concatenations only).
"""

from __future__ import annotations

import torch

from leangrpo_mcore.models.common.assembly import (Assembly, Source, assemble, disassemble, fused_qkv, identity,
                                                   interleave, meta_shapes)
from leangrpo_mcore.models.flux.config import FluxConfig


def expected_shapes(config: FluxConfig) -> dict[str, torch.Size]:
    """FULL shape of every parameter of the FLUX model described by ``config`` (built on the meta device)."""
    from leangrpo_mcore.models.flux.model import FluxTransformer

    return meta_shapes(FluxTransformer, config)


def _single_proj_out(key: str, shape: tuple[int, ...], config: FluxConfig) -> Assembly:
    dim, mlp = config.hidden_size, config.ffn_hidden_size
    sources = [Source(key, tuple(shape), 0, dim), Source(key, tuple(shape), dim, mlp)]
    return interleave(sources, groups=config.num_attention_heads, dim=1)


def diffusers_plan(config: FluxConfig) -> dict[str, Assembly]:
    """How each of our parameters is made of diffusers' tensors (see the module doc)."""
    plan = {}
    for name, shape in expected_shapes(config).items():
        shape = tuple(shape)
        fused = fused_qkv(name, shape, config.num_attention_heads)
        if fused is not None:
            plan[name] = fused
        elif name.startswith("single_transformer_blocks.") and name.endswith(".proj_out.weight"):
            plan[name] = _single_proj_out(name, shape, config)
        else:
            plan[name] = identity(name, shape)
    return plan


def diffusers_to_mcore(state_dict: dict, config: FluxConfig) -> dict:
    """Our state dict from a diffusers FluxTransformer2DModel state dict (views where nothing is fused)."""
    return assemble(state_dict, diffusers_plan(config), "FLUX diffusers")


def mcore_to_diffusers(state_dict: dict, config: FluxConfig) -> dict:
    """A diffusers FluxTransformer2DModel state dict from ours (no LoRA keys)."""
    return disassemble(state_dict, diffusers_plan(config), "FLUX policy")
