"""What crosses the step engine's boundary (its inputs, results and callbacks) and the records of one step's
prompt groups."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from leangrpo_mcore.diffusion.trajectory import Conditioning, Trajectory
from leangrpo_mcore.parallel.groups import PromptShare
from leangrpo_mcore.schedules.base import GroupUpdate

RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``reward_fn(final_latents (B, *shape), prompt_ids (B,)) -> (B,)`` float rewards, (B, K) component rewards with
:attr:`StepPlan.reward_weights` (with async scoring, ``reward_fn.submit`` with the same arguments returns a Future
of them, where it has one)."""
ProgressFn = Callable[[int, int], None]
"""``progress(done, total)``: after each denoising step of the rollout, how many of the step's ``total``
denoising steps (steps × this rank's micro-batches over its groups) are done."""


@dataclass
class StepInputs:
    """The prompts of one step."""

    step: int
    """Global step number (part of every seed)."""
    conditioning: Conditioning
    """One row per prompt slot (P rows)."""
    prompt_ids: torch.Tensor
    """(P,) long dataset ids of the prompts (handed to ``reward_fn``)."""


@dataclass
class UpdateResult:
    """One optimizer step of the rollout."""

    schedule: str
    """Schedule that produced the gradient."""
    loss: float
    """Update loss summed over data-parallel ranks."""
    grad_norm: float
    """Global gradient norm before clipping."""
    clipped: bool
    """Whether clipping scaled the gradient."""
    ratio_min: float
    ratio_max: float
    ratio_mean: float
    clip_fraction: float
    max_local_grad_buffers: int = 0
    """Most provisional gradients held at once on this rank (Reweight)."""
    per_step: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    """Per trained denoising step t: (Σρ, clipped ratios, ratios) over the data-parallel ranks."""


@dataclass
class StepResult:
    """Everything a step reports."""

    step: int
    rewards: torch.Tensor
    """(P, M) rewards of the step (all ranks); with component rewards their weighted sum Σ_k w_k r_k."""
    advantages: torch.Tensor
    """(P, M) clamped advantages."""
    updates: list[UpdateResult]
    """One entry per optimizer step."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: rollout, reward, advantage, recompute, backward, sync, clip, optimizer."""
    peak_memory_bytes: Optional[int] = None
    """Peak memory above the step's start (when measured)."""
    trajectories: dict[int, list[Trajectory]] = field(default_factory=dict)
    """This rank's trajectories per prompt slot (per micro-batch), when kept."""
    component_rewards: Optional[torch.Tensor] = None
    """(P, M, K) float32 component rewards of the step with reward.aggregate=advantages (None otherwise)."""
    window_start: Optional[int] = None
    """Start of the step's shared SDE window (fixed, progressive); None for a random window or none."""

    @property
    def loss(self) -> float:
        """Loss of the first update."""
        return self.updates[0].loss


@dataclass
class GroupRecord:
    """A prompt group's local share after its rollout."""

    share: PromptShare
    update: GroupUpdate
    group_rewards: torch.Tensor
    """(M,) float32 rewards of the whole group, generation order ((M, K) component rewards)."""


@dataclass
class ScoringGroup:
    """A prompt group's local share after its rollout, its rewards still being scored (async scoring)."""

    share: PromptShare
    trajectories: list[Trajectory]
    """The rollout of each micro-batch."""
    scores: list[Future]
    """Each micro-batch's Future of its (B_mb,) local rewards ((B_mb, K) component rewards)."""
