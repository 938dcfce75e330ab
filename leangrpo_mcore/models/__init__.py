"""Diffusion policies on megatron-core: FLUX and Wan, TE or local layers, TP, LoRA, checkpoints.

Entry points: :func:`build_policy` (random init from a seed), :func:`load_policy` (a diffusers
transformer directory or one of our checkpoints, resharded to the current TP size), :func:`save_policy`
and :func:`get_family`. See ``docs/models.md``.
"""

from leangrpo_mcore.models.backends import get_backend, resolve_backend
from leangrpo_mcore.models.common.lora import (
    LoRAConfig,
    apply_lora,
    disable_adapters,
    lora_parameters,
    mark_only_lora_trainable,
    merge_lora,
    unmerge_lora,
)
from leangrpo_mcore.models.registry import (
    ModelFamily,
    available_families,
    build_policy,
    get_family,
    load_policy,
    resolve_model_config,
    save_policy,
)

__all__ = [
    "LoRAConfig", "ModelFamily", "apply_lora", "available_families", "build_policy", "disable_adapters",
    "get_backend", "get_family", "load_policy", "lora_parameters", "mark_only_lora_trainable", "merge_lora",
    "resolve_backend", "resolve_model_config", "save_policy", "unmerge_lora",
]
