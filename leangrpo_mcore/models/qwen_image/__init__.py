"""Qwen-Image (QwenImageTransformer2DModel) policy family."""

from leangrpo_mcore.models.qwen_image.config import DIFFUSERS_CLASS_NAME, PRESETS, QwenImageConfig
from leangrpo_mcore.models.qwen_image.convert import diffusers_plan, diffusers_to_mcore, mcore_to_diffusers
from leangrpo_mcore.models.qwen_image.model import QwenImageTransformer
from leangrpo_mcore.models.registry import ModelFamily

LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)
"""The published Qwen-Image FlowGRPO LoRA targets: every projection of each block's joint attention and both
streams' MLPs (not the modulation, embedders or output layer)."""

FAMILY = ModelFamily(
    name="qwen_image",
    config_cls=QwenImageConfig,
    model_cls=QwenImageTransformer,
    diffusers_class_name=DIFFUSERS_CLASS_NAME,
    diffusers_to_mcore=diffusers_to_mcore,
    mcore_to_diffusers=mcore_to_diffusers,
    diffusers_plan=diffusers_plan,
    presets=PRESETS,
    lora_targets=LORA_TARGETS,
)

__all__ = ["FAMILY", "LORA_TARGETS", "PRESETS", "QwenImageConfig", "QwenImageTransformer", "diffusers_to_mcore",
           "mcore_to_diffusers"]
