"""The training engine: the run loop and the rooms it is built from.

    trainer.py        the run loop: build, resume, steps, samples, evaluation, checkpoints, summary
    build.py          the run's parts from the config (auto_layout.py, model_source.py, optim.py beside it)
    reward_bridge.py  the step engine's reward_fn: decode latents, score them, keep sample images
    references.py     an image-conditioned run's conditioning images, encoded once per prompt group
    step/             the step engine: rollout → reward → advantages → update → sync → clip → optimizer
    checkpoint/       sharded, verified checkpoints: save and publish, load, resume resolution
    control/          run control: the run directory's lock, preemption signals, the step watchdog, I/O
                      failures and non-finite updates
    output/           the run directory and what is written into it: metrics, TensorBoard, wandb, samples
    evaluate.py       evaluation prompts, rollouts and rewards (eval_run.py: the standalone evaluation)
    launch.py         the process: distributed setup, the rank-aware logger, one error on every rank
    throughput.py     the per-step throughput metrics
"""

from leangrpo_mcore.engine.optim import (
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    grad_norm,
    trainable_parameters,
)
from leangrpo_mcore.engine.step import StepEngine, StepInputs, StepPlan, StepResult, UpdateResult

__all__ = [
    "StepEngine", "StepInputs", "StepPlan", "StepResult", "UpdateResult", "build_lr_scheduler",
    "build_optimizer", "clip_grad_norm_", "grad_norm", "trainable_parameters",
]
