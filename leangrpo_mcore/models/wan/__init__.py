"""Wan2.1 / Wan2.2 text-to-video (WanTransformer3DModel) policy family, Wan2.2-A14B's two experts included."""

from leangrpo_mcore.models.registry import ModelFamily
from leangrpo_mcore.models.wan.config import DIFFUSERS_CLASS_NAME, EXPERTS, PRESETS, WanConfig
from leangrpo_mcore.models.wan.convert import mcore_name_to_diffusers, diffusers_plan, diffusers_to_mcore, mcore_to_diffusers
from leangrpo_mcore.models.wan.experts import WanExperts, wan_policy
from leangrpo_mcore.models.wan.model import WanModel

LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out")
"""Default LoRA targets: the q/k/v/out projections of the self- and cross-attention of every block."""

FAMILY = ModelFamily(
    name="wan",
    config_cls=WanConfig,
    model_cls=wan_policy,
    diffusers_class_name=DIFFUSERS_CLASS_NAME,
    diffusers_to_mcore=diffusers_to_mcore,
    mcore_to_diffusers=mcore_to_diffusers,
    diffusers_plan=diffusers_plan,
    presets=PRESETS,
    lora_targets=LORA_TARGETS,
    name_to_diffusers=mcore_name_to_diffusers,
)

__all__ = ["EXPERTS", "FAMILY", "LORA_TARGETS", "PRESETS", "WanConfig", "WanExperts", "WanModel", "diffusers_to_mcore",
           "mcore_to_diffusers", "wan_policy"]
