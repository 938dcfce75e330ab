"""Training-step wiring: rollout → reward → advantages → schedule update → sync → clip → optimizer."""

from leangrpo_mcore.engine.optim import (
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    grad_norm,
    trainable_parameters,
)
from leangrpo_mcore.engine.step import PhaseTimer, StepEngine, StepInputs, StepPlan, StepResult, UpdateResult

__all__ = [
    "PhaseTimer", "StepEngine", "StepInputs", "StepPlan", "StepResult", "UpdateResult", "build_lr_scheduler",
    "build_optimizer", "clip_grad_norm_", "grad_norm", "trainable_parameters",
]
