"""Model families and the policy entry points: build, load and save.

A family package (``leangrpo_mcore.models.flux``, ``leangrpo_mcore.models.wan``) exposes
``FAMILY = ModelFamily(...)``. Families are imported lazily, so a missing one only fails when asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch

from leangrpo_mcore.models.common import checkpoint as ckpt
from leangrpo_mcore.models.common.fp8 import fp8_config
from leangrpo_mcore.models.common.assembly import _check as check_shapes, stored_shapes
from leangrpo_mcore.models.common.materialize import (BoxReader, assembled_boxes, fill, init_rules, random_boxes,
                                                      source_boxes)
from leangrpo_mcore.models.common.pipeline import PipelineStage
from leangrpo_mcore.models.common.tp import capture_tp_layout, full_shape
from leangrpo_mcore.models.common.lora import LoRAConfig, apply_lora, lora_is_merged

FAMILY_MODULES = {"flux": "leangrpo_mcore.models.flux", "qwen_image": "leangrpo_mcore.models.qwen_image",
                  "sd3": "leangrpo_mcore.models.sd3", "wan": "leangrpo_mcore.models.wan"}


@dataclass(frozen=True)
class ModelFamily:
    """Everything generic code needs to know about one model family."""

    name: str
    """Short name used on the command line and in checkpoints ("flux", "wan")."""
    config_cls: type
    """TransformerConfig subclass with from_diffusers_config / to_diffusers_config."""
    model_cls: Callable[..., torch.nn.Module]
    """The policy module's class or factory: ``model_cls(config, *, backend="auto", stage=None)`` (``stage``: one
    pipeline stage,
    :class:`~leangrpo_mcore.models.common.pipeline.PipelineStage`; None: the whole model)."""
    diffusers_class_name: str
    """diffusers' ``_class_name`` in config.json (e.g. "FluxTransformer2DModel")."""
    diffusers_to_mcore: Callable[[dict, Any], dict]
    """Pure mapping of FULL tensors: diffusers state dict -> our parameter names."""
    mcore_to_diffusers: Callable[[dict, Any], dict]
    """Inverse mapping of :attr:`diffusers_to_mcore`."""
    diffusers_plan: Callable[[Any], dict]
    """``plan(config) -> {our name: Assembly}``: how each parameter is made of diffusers' tensors
    (:mod:`leangrpo_mcore.models.common.assembly`); both mappings above derive from it."""
    presets: dict[str, dict]
    """Named diffusers-style configs (e.g. "flux-dev", "wan2.1-1.3b", tiny test sizes)."""
    lora_targets: tuple[str, ...] = ()
    """Default LoRA target suffixes for this family (FlowGRPO's choice)."""
    name_to_diffusers: Optional[Callable[[str], str]] = None
    """Our parameter name -> diffusers' (None: the names are the same), used to name exported adapters."""
    fixed_diffusers_tensors: Optional[Callable[[Any], dict]] = None
    """``fixed(config) -> {diffusers name: shape}``: stored tensors that are functions of the config alone and no
    parameters of ours (SD3's positional table): accepted in a diffusers directory, never read."""


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; ValueError when unknown or not importable."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILY_MODULES))}")
    try:
        module = importlib.import_module(FAMILY_MODULES[name])
    except ImportError as exc:
        raise ValueError(f"model family {name!r} is not available ({exc})") from None
    family = getattr(module, "FAMILY", None)
    if not isinstance(family, ModelFamily):
        raise ValueError(f"model family {name!r} is not available ({FAMILY_MODULES[name]} defines no FAMILY)")
    return family


def available_families() -> list[ModelFamily]:
    """Every family that imports."""
    found = []
    for name in sorted(FAMILY_MODULES):
        try:
            found.append(get_family(name))
        except ValueError:
            continue
    return found


def family_for_diffusers_class(class_name: str) -> ModelFamily:
    """The family whose diffusers class is ``class_name``."""
    for family in available_families():
        if family.diffusers_class_name == class_name:
            return family
    raise ValueError(f"no model family handles diffusers class {class_name!r}")


def family_for_config(config: Any) -> ModelFamily:
    """The family whose config class ``config`` is an instance of."""
    for family in available_families():
        if isinstance(config, family.config_cls):
            return family
    raise ValueError(f"{type(config).__name__} is not the config of a known model family")


def _preset(name: str, family_name: str | None = None) -> tuple[ModelFamily, dict]:
    """A preset by name; with ``family_name`` only that family's (``tiny`` also finds ``<family>-tiny``, the family
    name spelled with hyphens: ``qwen-image-tiny``)."""
    if family_name is None:  # an exact preset name, whichever family owns it
        hits = [(family, family.presets[name]) for family in available_families() if name in family.presets]
    else:
        family = get_family(family_name)
        keys = (name, f"{family.name}-{name}", f"{family.name.replace('_', '-')}-{name}")
        hits = [(family, family.presets[key]) for key in keys if key in family.presets]
    if not hits:
        known = sorted(p for family in available_families() for p in family.presets)
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(known)}")
    return hits[0]


def resolve_model_config(model_config: Union[str, Mapping, Any]) -> tuple[ModelFamily, Any]:
    """(family, config) from a config instance, a preset name, or a mapping.

    A mapping holds ``family`` and/or ``preset`` plus diffusers-style hyper-parameters that override
    the preset's (e.g. ``{"preset": "flux-tiny", "num_layers": 2}``), and optionally
    ``activation_checkpointing`` (bool) and ``fp8`` (an FP8 recipe name, see ``common.fp8``).
    """
    if isinstance(model_config, str):
        family, hyper = _preset(model_config)
        return family, family.config_cls.from_diffusers_config(dict(hyper))
    if isinstance(model_config, Mapping):
        data = dict(model_config)
        preset, family_name = data.pop("preset", None), data.pop("family", None)
        checkpointing = data.pop("activation_checkpointing", None)
        fp8_recipe = data.pop("fp8", None)
        if preset is not None:
            family, hyper = _preset(preset, family_name)
            if family_name is not None and family_name != family.name:
                raise ValueError(f"preset {preset!r} belongs to family {family.name!r}, not {family_name!r}")
            data = {**hyper, **data}
        elif family_name is not None:
            family = get_family(family_name)
        else:
            raise ValueError("a model config mapping needs 'family' or 'preset'")
        config = family.config_cls.from_diffusers_config(data)
        if checkpointing is not None:
            config = dataclasses.replace(config, activation_checkpointing=bool(checkpointing))
        return family, fp8_config(config, fp8_recipe) if fp8_recipe else config
    return family_for_config(model_config), model_config


@dataclass
class PolicyFiles:
    """What a checkpoint directory holds, read from its metadata only (no weights)."""

    family: ModelFamily
    config: Any
    lora: Optional[LoRAConfig]
    """The adapters stored with the weights (our format), or None."""
    reader: BoxReader
    """Boxes of our parameters, read from the files (see ``common.materialize``)."""
    names: frozenset[str]
    """The parameters the files hold."""


def read_policy_files(path: Union[str, os.PathLike]) -> PolicyFiles:
    """Open a diffusers transformer directory (single file or sharded index) or one of our checkpoints lazily;
    CheckpointError (one line) when names or shapes do not match what its config implies."""
    if ckpt.is_policy_checkpoint(path):
        meta, source = ckpt.read_policy_checkpoint(path)
        family = get_family(meta["family"])
        config = family.config_cls.from_diffusers_config(meta["config"])
        lora = LoRAConfig.from_dict(meta["lora"]) if meta.get("lora") else None
        return PolicyFiles(family, config, lora, source_boxes(source), frozenset(source.keys()))
    hyper, source = ckpt.read_diffusers_dir(path)
    family = family_for_diffusers_class(str(hyper.get("_class_name")))
    config = family.config_cls.from_diffusers_config(hyper)
    plan = family.diffusers_plan(config)
    fixed = family.fixed_diffusers_tensors(config) if family.fixed_diffusers_tensors else {}
    check_shapes({k: torch.empty(source.shape(k), device="meta") for k in source.keys()},
                 {**stored_shapes(plan), **fixed}, f"{family.name} diffusers")
    return PolicyFiles(family, config, None, assembled_boxes(source, plan), frozenset(plan))


def meta_policy(family: ModelFamily, config: Any, backend: str, dtype: torch.dtype,
                lora: Optional[LoRAConfig] = None, stage: Optional[PipelineStage] = None) -> torch.nn.Module:
    """The policy (or its pipeline ``stage``) built on the ``meta`` device (no memory), with ``lora`` adapters
    attached."""
    with torch.device("meta"):
        model = _instantiate(family, config, backend, dtype, stage)
        if lora is not None:
            # A stage may hold none of a target's modules; the whole model holds them all.
            apply_lora(model, lora, require_match=stage is None or stage.is_whole)
    return model


def full_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """FULL (TP-gathered) shape of every parameter; call before FSDP2 wrapping."""
    return {name: tuple(full_shape(p)) for name, p in model.named_parameters()}


def materialize(model: torch.nn.Module, device: Union[str, torch.device], *, seed: int,
                files: Optional[PolicyFiles] = None, wrap: Optional[Callable[[torch.nn.Module], Any]] = None,
                layout: Optional[Mapping[str, torch.Tensor]] = None, fill_values: bool = True) -> torch.nn.Module:
    """Allocate a :func:`meta_policy` model's shards on ``device`` and fill them (``fill_values=False``: leave them
    as allocated, for a simulation that never reads them).

    ``wrap(model)`` runs on the meta model first (FSDP2 sharding), so only this rank's shards are allocated.
    Parameters in ``files`` are read from it box by box; the others (all without files, or adapters added on
    top of a checkpoint) get their seeded init, identical at every layout.
    """
    rules, shapes = init_rules(model), full_shapes(model)
    layout = layout if layout is not None else capture_tp_layout(model)
    if wrap is not None:
        wrap(model)
    # to_empty replaces meta parameters by new ones: carry their attributes (megatron's TP attributes, init
    # rules; FSDP2's DTensor parameters keep only the TP attributes, as fsdp.apply_fsdp does).
    attrs = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        for attr, value in attrs.get(name, {}).items():
            if not hasattr(param, attr):
                setattr(param, attr, value)
    if not fill_values:
        return model
    random = random_boxes(rules, shapes, seed)
    if files is None:
        fill(model, layout, random)
        return model
    fill(model, layout, files.reader, only=set(files.names))
    rest = {name for name, _ in model.named_parameters()} - set(files.names)
    if rest:
        fill(model, layout, random, only=rest)
    return model


def build_policy(model_config: Union[str, Mapping, Any], *, seed: int = 0, backend: str = "auto",
                 dtype: torch.dtype = torch.float32, stage: Optional[PipelineStage] = None) -> torch.nn.Module:
    """A randomly initialised policy; identical weights at every TP size for the same ``seed``. A pipeline
    ``stage`` holds the same values as the whole model under the same names (each is drawn from its name)."""
    family, config = resolve_model_config(model_config)
    return materialize(meta_policy(family, config, backend, dtype, stage=stage), "cpu", seed=seed)


def _instantiate(family: ModelFamily, config: Any, backend: str, dtype: torch.dtype,
                 stage: Optional[PipelineStage] = None) -> torch.nn.Module:
    # Parameters are filled afterwards (seeded init or a checkpoint): skip megatron's own init.
    config = dataclasses.replace(config, params_dtype=dtype, perform_initialization=False)
    return family.model_cls(config, backend=backend, stage=stage)


def load_policy(path: Union[str, os.PathLike], *, backend: str = "auto", dtype: torch.dtype = torch.float32,
                stage: Optional[PipelineStage] = None) -> torch.nn.Module:
    """Load a diffusers transformer directory or one of our checkpoints, resharded to this TP size, reading
    only this rank's slices; with a pipeline ``stage``, only that stage's parameters (a subset of the names).

    Run-time switches are not part of the checkpoint: set ``model.config.activation_checkpointing``
    after loading (the forward reads it on every call).
    """
    files = read_policy_files(path)
    model = meta_policy(files.family, files.config, backend, dtype, files.lora, stage)
    missing = sorted({name for name, _ in model.named_parameters()} - set(files.names))
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {path} does not match the model: {len(missing)} missing (e.g. "
                                   f"{missing[:2]})")
    return materialize(model, "cpu", seed=0, files=files)


def save_policy(model: torch.nn.Module, dst: Union[str, os.PathLike]) -> Optional[str]:
    """Save ``model`` in our format (FULL tensors, gathered over TP; rank 0 writes).

    Every TP rank must call it. Adapters must be unmerged (the file keeps base and adapters apart).
    Returns the directory on the writing rank, None elsewhere.
    """
    if lora_is_merged(model):
        raise ValueError("save_policy needs unmerged LoRA adapters (call unmerge_lora first)")
    family = family_for_config(model.config)
    tensors = ckpt.gather_state_dict(model)
    lora = getattr(model, "lora_config", None)
    written = None
    if ckpt.is_writer_rank():
        written = str(ckpt.write_policy_checkpoint(dst, family=family.name, config=model.config.to_diffusers_config(),
                                                   lora=None if lora is None else lora.to_dict(), tensors=tensors))
    ckpt.barrier()
    return written
