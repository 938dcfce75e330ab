"""FLUX.1 (FluxTransformer2DModel) policy family."""

from leangrpo_mcore.models.flux.config import PRESETS, FluxConfig
from leangrpo_mcore.models.flux.convert import diffusers_plan, diffusers_to_mcore, mcore_to_diffusers
from leangrpo_mcore.models.flux.model import FluxTransformer
from leangrpo_mcore.models.registry import ModelFamily

LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff", "ff_context",
)
"""FlowGRPO's FLUX LoRA targets: attention projections of every block and both double-block MLPs."""

FAMILY = ModelFamily(
    name="flux",
    config_cls=FluxConfig,
    model_cls=FluxTransformer,
    diffusers_class_name="FluxTransformer2DModel",
    diffusers_to_mcore=diffusers_to_mcore,
    mcore_to_diffusers=mcore_to_diffusers,
    diffusers_plan=diffusers_plan,
    presets=PRESETS,
    lora_targets=LORA_TARGETS,
)

__all__ = ["FAMILY", "LORA_TARGETS", "PRESETS", "FluxConfig", "FluxTransformer", "diffusers_to_mcore",
           "mcore_to_diffusers"]
