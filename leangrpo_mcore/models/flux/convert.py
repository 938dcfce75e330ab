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

import dataclasses

import torch

from leangrpo_mcore.models.common.assembly import Assembly, Source, assemble, disassemble, identity, interleave
from leangrpo_mcore.models.common.tp import full_shape
from leangrpo_mcore.models.flux.config import FluxConfig

# Our fused projection -> the diffusers projections it concatenates per head, in order.
FUSED_QKV = {"to_qkv": ("to_q", "to_k", "to_v"), "add_qkv_proj": ("add_q_proj", "add_k_proj", "add_v_proj")}


def expected_shapes(config: FluxConfig) -> dict[str, torch.Size]:
    """FULL shape of every parameter of the FLUX model described by ``config`` (built on the meta device)."""
    from leangrpo_mcore.models.flux.model import FluxTransformer

    meta_config = dataclasses.replace(config, perform_initialization=False, use_cpu_initialization=True)
    with torch.device("meta"):
        model = FluxTransformer(meta_config, backend="local")
    return {name: full_shape(param) for name, param in model.named_parameters()}


def _fused_qkv(name: str, shape: tuple[int, ...], heads: int) -> Assembly | None:
    prefix, fused, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
    if fused not in FUSED_QKV:
        return None
    stored = (shape[0] // 3,) + tuple(shape[1:])
    sources = [Source(f"{prefix}.{proj}.{kind}", stored, 0, stored[0]) for proj in FUSED_QKV[fused]]
    return interleave(sources, groups=heads)


def _single_proj_out(key: str, shape: tuple[int, ...], config: FluxConfig) -> Assembly:
    dim, mlp = config.hidden_size, config.ffn_hidden_size
    sources = [Source(key, tuple(shape), 0, dim), Source(key, tuple(shape), dim, mlp)]
    return interleave(sources, groups=config.num_attention_heads, dim=1)


def diffusers_plan(config: FluxConfig) -> dict[str, Assembly]:
    """How each of our parameters is made of diffusers' tensors (see the module doc)."""
    plan = {}
    for name, shape in expected_shapes(config).items():
        shape = tuple(shape)
        fused = _fused_qkv(name, shape, config.num_attention_heads)
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
