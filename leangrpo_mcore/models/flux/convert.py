"""diffusers FluxTransformer2DModel <-> our FLUX parameters, described once as an assembly plan.

Our parameter names are diffusers' names (the single-block ``proj_out`` keeps its full column order;
its TP split is a property of the parameter, see ``layers.FluxSingleBlock``), so every parameter is one stored
tensor as it is (:func:`~leangrpo_mcore.models.common.assembly.identity`); both directions derive from the plan
after a strict check of names and shapes against the config.
"""

from __future__ import annotations

import dataclasses

import torch

from leangrpo_mcore.models.common.assembly import Assembly, assemble, disassemble, identity
from leangrpo_mcore.models.common.tp import full_shape
from leangrpo_mcore.models.flux.config import FluxConfig


def expected_shapes(config: FluxConfig) -> dict[str, torch.Size]:
    """FULL shape of every parameter of the FLUX model described by ``config`` (built on the meta device)."""
    from leangrpo_mcore.models.flux.model import FluxTransformer

    meta_config = dataclasses.replace(config, perform_initialization=False, use_cpu_initialization=True)
    with torch.device("meta"):
        model = FluxTransformer(meta_config, backend="local")
    return {name: full_shape(param) for name, param in model.named_parameters()}


def diffusers_plan(config: FluxConfig) -> dict[str, Assembly]:
    """How each of our parameters is made of diffusers' tensors (here: each is the same-named tensor)."""
    return {name: identity(name, tuple(shape)) for name, shape in expected_shapes(config).items()}


def diffusers_to_mcore(state_dict: dict, config: FluxConfig) -> dict:
    """Our state dict (views, no copies) from a diffusers FluxTransformer2DModel state dict."""
    return assemble(state_dict, diffusers_plan(config), "FLUX diffusers")


def mcore_to_diffusers(state_dict: dict, config: FluxConfig) -> dict:
    """A diffusers FluxTransformer2DModel state dict (views, no copies) from ours (no LoRA keys)."""
    return disassemble(state_dict, diffusers_plan(config), "FLUX policy")
