"""Wan2.1 / Wan2.2-TI2V text-to-video (WanTransformer3DModel) policy family."""

from leangrpo_mcore.models.registry import ModelFamily
from leangrpo_mcore.models.wan.config import DIFFUSERS_CLASS_NAME, PRESETS, WanConfig
from leangrpo_mcore.models.wan.convert import mcore_name_to_diffusers, diffusers_plan, diffusers_to_mcore, mcore_to_diffusers
from leangrpo_mcore.models.wan.model import WanModel

LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out")
"""Default LoRA targets: the q/k/v/out projections of the self- and cross-attention of every block."""

FAMILY = ModelFamily(
    name="wan",
    config_cls=WanConfig,
    model_cls=WanModel,
    diffusers_class_name=DIFFUSERS_CLASS_NAME,
    diffusers_to_mcore=diffusers_to_mcore,
    mcore_to_diffusers=mcore_to_diffusers,
    diffusers_plan=diffusers_plan,
    presets=PRESETS,
    lora_targets=LORA_TARGETS,
    name_to_diffusers=mcore_name_to_diffusers,
)

__all__ = ["FAMILY", "LORA_TARGETS", "PRESETS", "WanConfig", "WanModel", "diffusers_to_mcore", "mcore_to_diffusers"]
