"""LeanGRPO-Retain (§4.2): keep the rollout's graphs of the selected steps, no recompute.

Selected steps run with gradients during the rollout; the latent is detached between steps, so each
step's graph is its own. Each graph is kept (with the KL term when β > 0: the reference mean is computed
right away, adapters disabled, no grad) until the group's advantages are known; then the summed objective
−A·Σ_t log p (+ β·Σ_t KL), in the exact form of :func:`~leangrpo_mcore.schedules.base.unit_loss` with
ρ ≡ 1, is backpropagated.

That backward runs over disjoint graphs (they share only parameter leaves), and it is executed graph by
graph in the canonical unit order shared with Native. One autograd call over all roots would compute
the same sum but accumulate the per-graph gradients in the engine's internal order; the fixed order
makes the accumulated gradient bitwise equal to Native's whenever the forwards are deterministic and the
gradient sync is the same: coalesced by default (one reduce-scatter per update), or per backward (after
each graph) to match the per-backward baseline bit for bit (``StepPlan.sync``). Memory grows with the number of kept graphs (|S| × micro-batches in flight).

Each kept graph is one micro-batch of megatron-core's pipeline scheduler (``get_forward_backward_func()``,
:mod:`leangrpo_mcore.parallel.pipeline`), one call per group: its ``forward_step_func`` hands the scheduler the
kept log p (the forward ran in the rollout), the loss function forms the unit loss and the scheduler runs the
backward. A schedule of 1F1B cannot hold Retain's deferred backward (its forwards are the rollout's, long before
the advantage exists). With pipeline stages it is GPipe-style instead: the rollout's forwards of a group's
micro-batches, the trained ones included, go through the stages together as megatron's forward-only schedule
with their graphs kept (:meth:`~leangrpo_mcore.parallel.stages.StagedVelocity.velocities`), and each stage's
scheduler call backpropagates its part of the kept graphs in the same order, the boundary gradients travelling
back over megatron's point-to-point module, so that stage s backpropagates graph i while stage s+1 works on
graph i+1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional

import torch

from leangrpo_mcore.diffusion.sampler import StepRecord
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.parallel.pipeline import loss_triple, run_micro_batches
from leangrpo_mcore.schedules.base import (GroupUpdate, GuardTerms, Schedule, UnitKey, guard_terms, kl_value,
                                           pipelined, register_schedule, unit_loss)


@dataclass
class _KeptUnit:
    log_prob: torch.Tensor
    """(B,) log p with its graph."""
    kl: Optional[torch.Tensor]
    """(B,) KL with its graph, or None."""
    train: torch.Tensor
    """(B,) bool."""
    step: Optional[StepRecord] = None
    """The step whose KL is still to be formed (pipeline stages: its reference forward joins the group's)."""
    conditioning: Optional[Conditioning] = None
    """The micro-batch's conditioning (with :attr:`step`)."""
    t: int = -1
    """The denoising step."""
    guard: Optional[GuardTerms] = None
    """GRPO-Guard's inputs (the kept mean with its graph), or None."""


@dataclass
class _Backward:
    """One megatron micro-batch: a kept graph and the advantages of its micro-batch."""

    unit: _KeptUnit
    advantages: torch.Tensor


PHASES = {"backward-compute": "backward"}
"""megatron's timer names → this schedule's phases (forming the loss of a kept graph is not timed apart)."""


@register_schedule("retain")
class RetainSchedule(Schedule):
    """Selected steps with grad in the rollout; one backward pass over the kept graphs per group."""

    recompute_free = True
    pipelined_rollout = True

    def begin_update(self, weight: float) -> None:
        """Start an update: no graphs kept yet."""
        super().begin_update(weight)
        self._kept: dict[UnitKey, list[_KeptUnit]] = {}

    def on_step(self, key: UnitKey, conditioning: Conditioning) -> Callable[[StepRecord], None]:
        """Keep the graph of every trained step of micro-batch ``key``."""
        kept = self._kept.setdefault(key, [])

        def keep(record: StepRecord) -> None:
            if not record.grad or not bool(record.train.any()):
                return
            # the kept forward is the rollout's: its own mean is μ_old
            guard = guard_terms(self.ctx.sde, self.ctx.objective, record.sde, record.sde.mean.detach(), record.sigma,
                                record.sigma_next)
            if self.ctx.objective.kl_beta > 0 and pipelined(self.ctx.velocity_fn) is not None:
                kept.append(_KeptUnit(log_prob=record.sde.log_prob, kl=None, train=record.train, step=record,
                                      conditioning=conditioning, t=record.t, guard=guard))
                return
            kl = self.step_kl(record.sde.mean, record.sde.std, record.latents, record.next_latents,
                              record.sigma, record.sigma_next, conditioning)
            kept.append(_KeptUnit(log_prob=record.sde.log_prob, kl=kl, train=record.train, t=record.t, guard=guard))

        return keep

    def _form_kl(self, units: list[_KeptUnit]) -> None:
        """Pipeline stages: the KL of the kept steps that wait for it, their reference forwards one forward-only
        call of megatron's schedule (a reference forward one at a time would cross the stages in lock-step)."""
        waiting = [unit for unit in units if unit.step is not None]
        if not waiting:
            return
        means = self.reference_means([(u.step.latents, u.step.next_latents, u.step.sigma, u.step.sigma_next,
                                       u.conditioning) for u in waiting])
        for unit, ref_mean in zip(waiting, means):
            step = unit.step
            unit.kl = kl_value(self.ctx.sde, self.ctx.objective, step.sde.mean, ref_mean, step.sde.std, step.sigma,
                               step.sigma_next)
            unit.step = unit.conditioning = None

    def on_advantages(self, group: GroupUpdate) -> None:
        """Backpropagate the group's kept graphs, scaled by their advantages (one megatron micro-batch each, in
        the canonical order); each graph's buffers are freed by its backward."""
        backwards = []
        for mb, advantages in enumerate(group.advantages):
            units = self._kept.pop((group.index, mb), [])
            advantages = advantages.to(units[0].log_prob.device) if units else advantages
            backwards.extend(_Backward(unit, advantages) for unit in units)
        self._form_kl([backward.unit for backward in backwards])
        run_micro_batches(self.forward_step, backwards, self.ctx.grad_sync, phase=self.ctx.phase, phases=PHASES)

    def forward_step(self, data_iterator: Iterator[_Backward], model) -> tuple[torch.Tensor, Callable]:
        """megatron's ``forward_step_func``: the kept log p of the next graph (its forward was the rollout's)."""
        backward = next(data_iterator)
        return backward.unit.log_prob, partial(self.loss_func, backward)

    def loss_func(self, backward: _Backward, log_prob: torch.Tensor):
        """(loss, num_tokens, reduced): the unit loss at ρ ≡ 1 (see parallel/pipeline.py)."""
        unit = backward.unit
        loss, ratio = unit_loss(log_prob, log_prob.detach(), backward.advantages, unit.train, self.weight,
                                self.ctx.objective, unit.kl, unit.guard)
        self.stats.add(ratio, loss, step=unit.t)
        return loss_triple(loss)
