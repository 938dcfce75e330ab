"""Native: the baselines' update (docs/algorithms.md §5).

The rollout runs without gradients and stores every transition. When a group's advantages are known,
each selected step of each micro-batch is *recomputed*: the policy runs again, with gradients, on the
stored x_t, log p is evaluated at the stored x_{t+1}, and that unit's loss is backpropagated at once.
Gradient synchronisation is the injected :class:`~leangrpo_mcore.parallel.grad_sync.GradSync`: a
reduce-scatter per backward like the baselines (``per_backward``), or deferred to one reduce-scatter
per update (``coalesced``, the ``schedule.coalesce_sync`` ablation). It is also the schedule of every
update after the first one of a rollout (the policy has moved, so the rollout's graphs are stale).

Units are processed in the canonical order shared with Retain — micro-batches in rollout order, steps
ascending — so both accumulate the same per-unit gradients in the same order. Each unit is one micro-batch of
megatron-core's pipeline scheduler (``get_forward_backward_func()``, :mod:`leangrpo_mcore.parallel.pipeline`):
:meth:`NativeSchedule.forward_step` is its ``forward_step_func``, one scheduler call per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional

import torch

from leangrpo_mcore.diffusion.trajectory import Trajectory
from leangrpo_mcore.parallel.pipeline import run_micro_batches, token_count
from leangrpo_mcore.schedules.base import GroupUpdate, Schedule, register_schedule, unit_loss

PHASES = {"forward-compute": "recompute", "backward-compute": "backward"}
"""megatron's timer names → this schedule's phases: forward + loss of a unit, its backward."""


@dataclass(frozen=True)
class RecomputeUnit:
    """One micro-batch of megatron's scheduler: step ``t`` of a rollout micro-batch, recomputed with grad."""

    traj: Trajectory
    """The rollout micro-batch."""
    advantages: torch.Tensor
    """(B_mb,) float32 advantages on the trajectory's device."""
    t: int
    """The step."""


@register_schedule("native")
class NativeSchedule(Schedule):
    """No-grad rollout, recompute + backward per selected step."""

    recompute_free = False

    def on_advantages(self, group: GroupUpdate) -> None:
        """Recompute and backpropagate every selected unit of the group: one megatron micro-batch each."""
        units = []
        for traj, advantages in zip(group.trajectories, group.advantages):
            advantages = advantages.to(traj.latents.device)
            units.extend(RecomputeUnit(traj, advantages, t) for t in range(traj.num_steps)
                         if bool(traj.selected[:, t].any()))
        run_micro_batches(self.forward_step, units, self.ctx.grad_sync, phase=self.ctx.phase, phases=PHASES)

    def forward_step(self, data_iterator: Iterator[RecomputeUnit], model) -> tuple[torch.Tensor, Callable]:
        """megatron's ``forward_step_func``: the unit's recompute; its loss is formed by the returned loss_func."""
        unit = next(data_iterator)
        traj, t = unit.traj, unit.t
        out = self.recompute(traj, t)
        kl = self.step_kl(out.mean, out.std, traj.latents[:, t], traj.next_latents[:, t],
                          traj.sigmas[:, t], traj.sigmas[:, t + 1], traj.conditioning)
        return out.log_prob, partial(self.loss_func, unit, kl)

    def loss_func(self, unit: RecomputeUnit, kl: Optional[torch.Tensor], log_prob: torch.Tensor):
        """(loss, num_tokens, reduced): the unit loss as megatron backpropagates it (see parallel/pipeline.py)."""
        train = unit.traj.selected[:, unit.t]
        loss, ratio = unit_loss(log_prob, unit.traj.log_probs[:, unit.t], unit.advantages, train, self.weight,
                                self.ctx.objective, kl)
        self.stats.add(ratio, loss)
        return loss, token_count(), {"loss": loss.detach()}
