"""diffusers' ``WanTransformer3DModel`` <-> :class:`WanModel`, described once as an assembly plan.

Nothing changes a value: names are renamed, the 3-D patch embedding's convolution kernel (D, C, pt, ph, pw)
is viewed as the equivalent linear weight (D, C*pt*ph*pw) (a stride-equals-kernel convolution is a linear map on
flattened patches), and the fused projections interleave diffusers' separate ones per head (self-attention
``to_qkv`` from ``to_q`` / ``to_k`` / ``to_v``, cross-attention ``to_kv`` from ``to_k`` / ``to_v``; see
``layers``), so a round trip is bit-exact. Both directions on FULL tensors and the sharded checkpoint
readers derive from :func:`diffusers_plan`; inputs are checked against the shapes the config implies, so a wrong
model or a corrupt file gives one line. A two-expert policy (Wan2.2-A14B) maps each expert to its pipeline
component: ours ``high.*`` / ``low.*`` are diffusers' ``transformer.*`` / ``transformer_2.*``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from leangrpo_mcore.models.common.assembly import Assembly, Piece, Source, assemble, disassemble, interleave
from leangrpo_mcore.models.wan.config import DIFFUSERS_EXPERTS, WanConfig

# (diffusers pattern, our pattern) and the inverse: blocks live in ``layers`` (so that ``WanModel.blocks()`` can
# be a method), the Dropout slots of diffusers' Sequentials disappear; every other name is kept.
_TO_MCORE = (
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", r"condition_embedder.image_embedder.fc1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", r"condition_embedder.image_embedder.fc2."),
    (r"^blocks\.(\d+)\.attn([12])\.to_out\.0\.", r"layers.\1.attn\2.to_out."),
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"layers.\1.ffn.fc1."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"layers.\1.ffn.fc2."),
    (r"^blocks\.(\d+)\.", r"layers.\1."),
)
_TO_DIFFUSERS = (
    (r"^condition_embedder\.image_embedder\.fc1\.", r"condition_embedder.image_embedder.ff.net.0.proj."),
    (r"^condition_embedder\.image_embedder\.fc2\.", r"condition_embedder.image_embedder.ff.net.2."),
    (r"^layers\.(\d+)\.attn([12])\.to_out\.", r"blocks.\1.attn\2.to_out.0."),
    (r"^layers\.(\d+)\.ffn\.fc1\.", r"blocks.\1.ffn.net.0.proj."),
    (r"^layers\.(\d+)\.ffn\.fc2\.", r"blocks.\1.ffn.net.2."),
    (r"^layers\.(\d+)\.", r"blocks.\1."),
)
_PATCH_WEIGHT = "patch_embedding.weight"
# Our fused projection of each attention -> the diffusers projections it interleaves per head, in order.
FUSED = {"attn1": ("to_qkv", ("to_q", "to_k", "to_v")), "attn2": ("to_kv", ("to_k", "to_v"))}
# The image keys and values of Wan2.1-I2V's cross-attention, fused the same way.
ADDED_KV = ("attn2", "to_added_kv", ("add_k_proj", "add_v_proj"))


def diffusers_shapes(config: WanConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a diffusers ``WanTransformer3DModel`` state dict for ``config``."""
    dim, ffn, freq = config.hidden_size, config.ffn_hidden_size, config.freq_dim
    shapes: dict[str, tuple[int, ...]] = {
        "scale_shift_table": (1, 2, dim),
        _PATCH_WEIGHT: (dim, config.in_channels, *config.patch_size),
        "patch_embedding.bias": (dim,),
        "proj_out.weight": (config.out_channels * math.prod(config.patch_size), dim),
        "proj_out.bias": (config.out_channels * math.prod(config.patch_size),),
    }
    _add_linear(shapes, "condition_embedder.time_embedder.linear_1", freq, dim)
    _add_linear(shapes, "condition_embedder.time_embedder.linear_2", dim, dim)
    _add_linear(shapes, "condition_embedder.time_proj", dim, 6 * dim)
    _add_linear(shapes, "condition_embedder.text_embedder.linear_1", config.text_dim, dim)
    _add_linear(shapes, "condition_embedder.text_embedder.linear_2", dim, dim)
    if config.image_dim is not None:
        image = "condition_embedder.image_embedder"
        for norm, width in (("norm1", config.image_dim), ("norm2", dim)):
            shapes[f"{image}.{norm}.weight"] = shapes[f"{image}.{norm}.bias"] = (width,)
        _add_linear(shapes, f"{image}.ff.net.0.proj", config.image_dim, config.image_dim)
        _add_linear(shapes, f"{image}.ff.net.2", config.image_dim, dim)
    for i in range(config.num_layers):
        p = f"blocks.{i}"
        shapes[f"{p}.scale_shift_table"] = (1, 6, dim)
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                _add_linear(shapes, f"{p}.{attn}.{proj}", dim, dim)
            shapes[f"{p}.{attn}.norm_q.weight"] = (dim,)
            shapes[f"{p}.{attn}.norm_k.weight"] = (dim,)
        if config.added_kv_proj_dim is not None:
            _add_linear(shapes, f"{p}.attn2.add_k_proj", config.added_kv_proj_dim, dim)
            _add_linear(shapes, f"{p}.attn2.add_v_proj", config.added_kv_proj_dim, dim)
            shapes[f"{p}.attn2.norm_added_k.weight"] = (dim,)
        if config.cross_attn_norm:
            shapes[f"{p}.norm2.weight"] = (dim,)
            shapes[f"{p}.norm2.bias"] = (dim,)
        _add_linear(shapes, f"{p}.ffn.net.0.proj", dim, ffn)
        _add_linear(shapes, f"{p}.ffn.net.2", ffn, dim)
    return shapes


def _add_linear(shapes: dict[str, tuple[int, ...]], name: str, fan_in: int, fan_out: int) -> None:
    shapes[f"{name}.weight"] = (fan_out, fan_in)
    shapes[f"{name}.bias"] = (fan_out,)


def _rename(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, repl in rules:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def diffusers_name_to_mcore(name: str) -> str:
    """Our parameter name for a diffusers Wan parameter name."""
    return _rename(name, _TO_MCORE)


def mcore_name_to_diffusers(name: str) -> str:
    """The diffusers Wan parameter name for one of our parameter names (an expert's ``high.`` / ``low.`` prefix
    becomes its pipeline component's, ``transformer.`` / ``transformer_2.``)."""
    ours, _, rest = name.partition(".")
    if ours in DIFFUSERS_EXPERTS and rest:
        return f"{DIFFUSERS_EXPERTS[ours]}.{_rename(rest, _TO_DIFFUSERS)}"
    return _rename(name, _TO_DIFFUSERS)


def mcore_shapes(config: WanConfig) -> dict[str, tuple[int, ...]]:
    """Name -> FULL (TP-gathered) shape of every parameter of :class:`WanModel` for ``config``."""
    return {name: assembly.full_shape for name, assembly in diffusers_plan(config).items()}


def _fused_plan(config: WanConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Assembly]:
    plan = {}
    fusions = [(attn, fused, projections) for attn, (fused, projections) in FUSED.items()]
    if config.added_kv_proj_dim is not None:
        fusions.append(ADDED_KV)
    for i in range(config.num_layers):
        for attn, fused, projections in fusions:
            for kind in ("weight", "bias"):
                keys = [f"blocks.{i}.{attn}.{proj}.{kind}" for proj in projections]
                sources = [Source(key, shapes[key], 0, shapes[key][0]) for key in keys]
                plan[f"layers.{i}.{attn}.{fused}.{kind}"] = interleave(sources, groups=config.num_attention_heads)
    return plan


def diffusers_plan(config: WanConfig) -> dict[str, Assembly]:
    """How each of our parameters is made of diffusers' tensors (renames, the patch kernel viewed as a linear,
    the fused projections interleaved per head). A two-expert policy's ``high.<name>`` / ``low.<name>`` are
    each expert's plan over the tensors of its pipeline component, ``transformer.<key>`` / ``transformer_2.<key>``."""
    if config.boundary_ratio is None:
        return expert_plan(config)
    plan = {}
    for ours, component in DIFFUSERS_EXPERTS.items():
        for name, assembly in expert_plan(config).items():
            pieces = tuple(dataclasses.replace(p, key=f"{component}.{p.key}") for p in assembly.pieces)
            plan[f"{ours}.{name}"] = Assembly(pieces, assembly.dim)
    return plan


def expert_plan(config: WanConfig) -> dict[str, Assembly]:
    """:func:`diffusers_plan` of one transformer (names without an expert prefix)."""
    shapes = diffusers_shapes(config)
    plan = _fused_plan(config, shapes)
    fused_keys = {piece.key for assembly in plan.values() for piece in assembly.pieces}
    for key, stored in shapes.items():
        if key in fused_keys:
            continue
        shape = (stored[0], math.prod(stored[1:])) if key == _PATCH_WEIGHT else stored
        plan[diffusers_name_to_mcore(key)] = Assembly((Piece(key, stored, shape),))
    return plan


def diffusers_to_mcore(state_dict: dict[str, torch.Tensor], config: WanConfig) -> dict[str, torch.Tensor]:
    """Map a FULL diffusers ``WanTransformer3DModel`` state dict to our parameter names and layouts."""
    return assemble(state_dict, diffusers_plan(config), "Wan diffusers")


def mcore_to_diffusers(state_dict: dict[str, torch.Tensor], config: WanConfig) -> dict[str, torch.Tensor]:
    """Map a FULL state dict of :class:`WanModel` to diffusers ``WanTransformer3DModel`` names and layouts."""
    return disassemble(state_dict, diffusers_plan(config), "Wan leangrpo_mcore")
