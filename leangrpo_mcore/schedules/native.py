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
:meth:`NativeSchedule.forward_step` is its ``forward_step_func``, one scheduler call per group. With pipeline
stages (``parallel.pp`` > 1) the call is megatron's 1F1B schedule over the stages, so that the stages recompute
different units at once; the reference forwards of the KL term (no grad) run before it, as one forward-only call
over the units, and each unit carries its reference mean into the schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional

import torch

from leangrpo_mcore.diffusion.trajectory import Trajectory
from leangrpo_mcore.parallel.pipeline import loss_triple, run_micro_batches
from leangrpo_mcore.schedules.base import (GroupUpdate, GuardTerms, Schedule, guard_terms, kl_value, pipelined,
                                           register_schedule, unit_loss)


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
    ref_mean: Optional[torch.Tensor] = None
    """The reference policy's SDE mean of the step, computed before the schedule (pipeline stages, KL)."""


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
        staged = pipelined(self.ctx.velocity_fn)
        if staged is None:
            run_micro_batches(self.forward_step, units, self.ctx.grad_sync, phase=self.ctx.phase, phases=PHASES)
            return
        if self.ctx.objective.kl_beta > 0:
            steps = [(u.traj.latents[:, u.t], u.traj.next_latents[:, u.t], u.traj.sigmas[:, u.t],
                      u.traj.sigmas[:, u.t + 1], u.traj.conditioning) for u in units]
            units = [dataclasses.replace(unit, ref_mean=mean) for unit, mean in zip(units, self.reference_means(steps))]
        shape = staged.boundary_shape([(u.traj.latents[:, u.t], u.traj.sigmas[:, u.t], u.traj.conditioning)
                                       for u in units])
        with staged.scheduled():
            run_micro_batches(self.forward_step, units, self.ctx.grad_sync, phase=self.ctx.phase, phases=PHASES,
                              dtype=staged.link.dtype, pipeline=staged.policy, tensor_shape=shape)

    def forward_step(self, data_iterator: Iterator[RecomputeUnit], model) -> tuple[torch.Tensor, Optional[Callable]]:
        """megatron's ``forward_step_func``: the unit's recompute; its loss is formed by the returned loss_func.
        On a pipeline stage other than the last: the unit's boundary tensor (the schedule sends it on)."""
        unit = next(data_iterator)
        traj, t = unit.traj, unit.t
        staged = pipelined(self.ctx.velocity_fn)
        if staged is not None and not staged.link.last:
            with torch.enable_grad(), self.ctx.precision(True):
                return staged.boundary(traj.latents[:, t], traj.sigmas[:, t], traj.conditioning), None
        out = self.recompute(traj, t)
        sigma, sigma_next = traj.sigmas[:, t], traj.sigmas[:, t + 1]
        if unit.ref_mean is not None:
            kl = kl_value(self.ctx.sde, self.ctx.objective, out.mean, unit.ref_mean, out.std, sigma, sigma_next)
        else:
            kl = self.step_kl(out.mean, out.std, traj.latents[:, t], traj.next_latents[:, t], sigma, sigma_next,
                              traj.conditioning)
        # GRPO-Guard: the rollout's mean, kept in the trajectory (the policy may have moved since)
        old_mean = None if traj.means is None else traj.means[:, t]
        guard = guard_terms(self.ctx.sde, self.ctx.objective, out, old_mean, sigma, sigma_next)
        return out.log_prob, partial(self.loss_func, unit, kl, guard)

    def loss_func(self, unit: RecomputeUnit, kl: Optional[torch.Tensor], guard: Optional[GuardTerms],
                  log_prob: torch.Tensor):
        """(loss, num_tokens, reduced): the unit loss as megatron backpropagates it (see parallel/pipeline.py)."""
        train = unit.traj.selected[:, unit.t]
        loss, ratio = unit_loss(log_prob, unit.traj.log_probs[:, unit.t], unit.advantages, train, self.weight,
                                self.ctx.objective, kl, guard)
        self.stats.add(ratio, loss, step=unit.t)
        return loss_triple(loss)
