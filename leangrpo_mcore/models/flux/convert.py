"""diffusers FluxTransformer2DModel <-> our FLUX parameters (pure mappings on FULL tensors).

Our parameter names are diffusers' names (the single-block ``proj_out`` keeps its full column order;
its TP split is a property of the parameter, see ``layers.FluxSingleBlock``), so both directions are
the identity on names and tensors after a strict check of names and shapes against the config.
"""

from __future__ import annotations

import dataclasses

import torch

from leangrpo_mcore.models.common.tp import full_shape
from leangrpo_mcore.models.flux.config import FluxConfig


def expected_shapes(config: FluxConfig) -> dict[str, torch.Size]:
    """FULL shape of every parameter of the FLUX model described by ``config`` (built on the meta device)."""
    from leangrpo_mcore.models.flux.model import FluxTransformer

    meta_config = dataclasses.replace(config, perform_initialization=False, use_cpu_initialization=True)
    with torch.device("meta"):
        model = FluxTransformer(meta_config, backend="local")
    return {name: full_shape(param) for name, param in model.named_parameters()}


def _checked(state_dict: dict, config: FluxConfig, what: str) -> dict:
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f"not a FLUX {what} state dict for this config: {len(missing)} missing (e.g. {missing[:2]}), "
                         f"{len(unexpected)} unexpected (e.g. {unexpected[:2]})")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(state_dict[name].shape)} != expected {tuple(shape)}")
    return {name: state_dict[name] for name in sorted(expected)}


def diffusers_to_mcore(state_dict: dict, config: FluxConfig) -> dict:
    """Our state dict (same tensor objects) from a diffusers FluxTransformer2DModel state dict."""
    return _checked(state_dict, config, "diffusers")


def mcore_to_diffusers(state_dict: dict, config: FluxConfig) -> dict:
    """A diffusers FluxTransformer2DModel state dict (same tensor objects) from ours (no LoRA keys)."""
    return _checked(state_dict, config, "policy")
