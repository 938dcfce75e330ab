"""Stable Diffusion 3 / 3.5 (SD3Transformer2DModel) policy family."""

from leangrpo_mcore.models.registry import ModelFamily
from leangrpo_mcore.models.sd3.config import DIFFUSERS_CLASS_NAME, PRESETS, SD3Config
from leangrpo_mcore.models.sd3.convert import diffusers_plan, diffusers_to_mcore, fixed_tensors, mcore_to_diffusers
from leangrpo_mcore.models.sd3.model import SD3Transformer

LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)
"""FlowGRPO's SD3 LoRA targets: the joint attention's projections of every block (not ``attn2``, not the MLPs)."""

FAMILY = ModelFamily(
    name="sd3",
    config_cls=SD3Config,
    model_cls=SD3Transformer,
    diffusers_class_name=DIFFUSERS_CLASS_NAME,
    diffusers_to_mcore=diffusers_to_mcore,
    mcore_to_diffusers=mcore_to_diffusers,
    diffusers_plan=diffusers_plan,
    presets=PRESETS,
    lora_targets=LORA_TARGETS,
    fixed_diffusers_tensors=fixed_tensors,
)

__all__ = ["FAMILY", "LORA_TARGETS", "PRESETS", "SD3Config", "SD3Transformer", "diffusers_to_mcore",
           "mcore_to_diffusers"]
