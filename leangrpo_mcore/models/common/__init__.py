"""Model building blocks shared by every family (TP helpers, norms, RoPE, LoRA, checkpoints, FP8)."""

from leangrpo_mcore.models.common.activation_checkpoint import maybe_checkpoint
from leangrpo_mcore.models.common.embeddings import MLPEmbedder, modulate, timestep_embedding
from leangrpo_mcore.models.common.init import constant_init, init_parameters, normal_init, set_init, uniform_fan_in
from leangrpo_mcore.models.common.lora import (
    LoRAConfig,
    apply_lora,
    disable_adapters,
    lora_parameters,
    mark_only_lora_trainable,
    merge_lora,
    unmerge_lora,
)
from leangrpo_mcore.models.common.norms import LayerNorm, RMSNorm, TPRMSNorm
from leangrpo_mcore.models.common.rope import apply_rotary, multi_axis_rope_cos_sin, rope_cos_sin
from leangrpo_mcore.models.common.tp import (
    all_reduce_tp,
    copy_to_tp,
    divide,
    mark_tp_partitioned,
    tp_group,
    tp_rank,
    tp_world_size,
)

__all__ = [
    "LayerNorm", "LoRAConfig", "MLPEmbedder", "RMSNorm", "TPRMSNorm", "all_reduce_tp", "apply_lora",
    "apply_rotary", "constant_init", "copy_to_tp", "disable_adapters", "divide", "init_parameters",
    "lora_parameters", "mark_only_lora_trainable", "mark_tp_partitioned", "maybe_checkpoint", "merge_lora",
    "modulate", "multi_axis_rope_cos_sin", "normal_init", "rope_cos_sin", "set_init", "timestep_embedding",
    "tp_group", "tp_rank", "tp_world_size", "uniform_fan_in", "unmerge_lora",
]
