"""The update-schedule strategy interface, its registry, and the loss every schedule shares.

A schedule turns rollouts + advantages into gradients. The engine drives it through hooks, per prompt
group held by this rank (docs/algorithms.md §5–6)::

    begin_update(weight)                      # weight = 1 / (samples × selected steps of the update)
    for each group, for each micro-batch:
        rollout(grad_steps=schedule.grad_steps(selected), on_step=schedule.on_step(key, conditioning))
        schedule.on_rewards(key, local rewards)
    schedule.on_group_rewards(group)          # the group's rewards are gathered (mean known)
    schedule.on_advantages(group)             # advantages known (at once, or at step end with global std)
    schedule.finish_update()                  # → grad_sync.finish(): reduced gradients ready

Only dataclasses and tensors cross these boundaries; schedules see the velocity function, the SDE and an
injected :class:`~leangrpo_mcore.parallel.grad_sync.GradSync`, never the optimizer.

The loss of one *unit* (the forward of one micro-batch at one step) is defined once here,
:func:`unit_loss`, and used unchanged by every schedule, so that identical inputs give identical graphs:
L = weight · Σ_{train rows} [ max(−A·ρ, −A·clip(ρ, 1±ε)) + β·KL ], ρ = exp(log p − log p_old). The weight
is the same for all schedules and layouts: one over the number of (sample, selected step) pairs of the
whole update over every rank (the baselines' batch mean), with gradients summed over ranks.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Optional

import torch

from leangrpo_mcore.diffusion.sampler import SDEParams, StepRecord, TrainedRow
from leangrpo_mcore.diffusion.sde import SDEStep
from leangrpo_mcore.diffusion.trajectory import Conditioning, Trajectory
from leangrpo_mcore.diffusion.velocity import VelocityFn
from leangrpo_mcore.parallel.grad_sync import GradSync
from leangrpo_mcore.parallel.precision import ForwardPrecision, null_precision
from leangrpo_mcore.rl.loss import (GRAD_REWEIGHTS, clipped_surrogate, grpo_step_loss, guard_step_weight, kl_loss,
                                    ratio_norm_log_ratio)
from leangrpo_mcore.schedules.stats import UpdateStats

UnitKey = tuple[int, int]
"""(prompt slot of the group, micro-batch index within this rank's share of the group)."""

SCHEDULES: dict[str, type["Schedule"]] = {}


def register_schedule(name: str) -> Callable[[type["Schedule"]], type["Schedule"]]:
    """Class decorator registering a schedule under ``name`` (``schedule.name`` in the config)."""

    def decorator(cls: type[Schedule]) -> type[Schedule]:
        if name in SCHEDULES:
            raise ValueError(f"schedule {name!r} is already registered")
        cls.name = name
        SCHEDULES[name] = cls
        return cls

    return decorator


def available_schedules() -> list[str]:
    """Registered schedule names, sorted."""
    return sorted(SCHEDULES)


def build_schedule(name: str, context: "ScheduleContext", **options) -> "Schedule":
    """Instantiate the schedule registered as ``name``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(available_schedules())}")
    return SCHEDULES[name](context, **options)


@dataclass(frozen=True)
class Objective:
    """The GRPO objective of an update (docs/algorithms.md §4)."""

    clip_range: float = 1e-4
    """ε of the clipped ratio."""
    kl_beta: float = 0.0
    """β of the KL term (0: no reference forward at all)."""
    kl_form: str = "flow_grpo"
    """``flow_grpo`` (divide by 2·std_t²) or ``exact`` (true Gaussian KL)."""
    ratio_norm: bool = False
    """GRPO-Guard's RatioNorm of each step's log-ratio (:func:`~leangrpo_mcore.rl.loss.ratio_norm_log_ratio`)."""
    grad_reweight: str = "none"
    """GRPO-Guard's per-step weight of the clipped surrogate: none, flow_grpo or dancegrpo
    (:func:`~leangrpo_mcore.rl.loss.guard_step_weight`)."""

    def __post_init__(self) -> None:
        if self.grad_reweight not in GRAD_REWEIGHTS:
            raise ValueError(f"unknown gradient reweighting {self.grad_reweight!r}; valid: {', '.join(GRAD_REWEIGHTS)}")

    @property
    def guarded(self) -> bool:
        """Whether GRPO-Guard changes the unit loss (either part on)."""
        return self.ratio_norm or self.grad_reweight != "none"


@dataclass(frozen=True)
class GuardTerms:
    """What GRPO-Guard's parts of a unit loss read besides the log-probabilities (docs/algorithms.md §9)."""

    mean: torch.Tensor
    """(B, *shape) SDE mean μ of the step, with its graph."""
    old_mean: torch.Tensor
    """(B, *shape) μ_old of the rollout (detached; on the first update the same values as ``mean``)."""
    std: torch.Tensor
    """(B, 1, ..., 1) transition std s of the step."""
    weight: Optional[torch.Tensor]
    """(B,) float32 gradient weight of the step (None: grpo.grad_reweight none)."""
    sample_mean: Callable[[torch.Tensor], torch.Tensor]
    """Mean over a sample's elements (a context-parallel reduction under a split)."""


def guard_terms(sde: SDEParams, objective: Objective, step: SDEStep, old_mean: Optional[torch.Tensor],
                sigma: torch.Tensor, sigma_next: torch.Tensor) -> Optional[GuardTerms]:
    """GRPO-Guard's inputs of a step (``step`` the policy's SDE step of it, ``old_mean`` the rollout's mean), None
    when the objective uses neither part. Retain and Reweight pass ``step.mean.detach()`` (their forward is the
    rollout's); Native the mean its rollout kept (the policy has moved in a later update)."""
    if not objective.guarded:
        return None
    if objective.ratio_norm and old_mean is None:
        raise ValueError("grpo.ratio_norm needs the rollout's SDE means: the rollout did not keep them")
    weight = None
    if objective.grad_reweight != "none":
        weight = guard_step_weight(objective.grad_reweight, sigma, sigma_next, sde.noise_level).to(step.mean.device)
    return GuardTerms(mean=step.mean, old_mean=step.mean.detach() if old_mean is None else old_mean, std=step.std,
                      weight=weight, sample_mean=sde.sample_mean)


def loss_weight(num_samples: int, steps_per_sample: int) -> float:
    """The one loss normaliser: 1 / (samples × selected steps) of the whole update, all ranks together."""
    if num_samples < 1 or steps_per_sample < 1:
        raise ValueError(f"an update needs samples and steps, got {num_samples} and {steps_per_sample}")
    return 1.0 / (num_samples * steps_per_sample)


@dataclass
class ScheduleContext:
    """What a schedule is given (injected by the engine)."""

    velocity_fn: VelocityFn
    """Policy call: (latents, sigma, conditioning) → float32 velocity."""
    sde: SDEParams
    """SDE variant and schedule constants."""
    objective: Objective
    """Clip range and KL settings."""
    grad_sync: GradSync
    """Gradient synchronisation strategy."""
    precision: ForwardPrecision = null_precision
    """Context around every policy forward (``grad`` tells trained from rollout-only forwards)."""
    phase: Callable[[str], ContextManager] = field(default=lambda name: contextlib.nullcontext())
    """Timer hook: ``with phase("backward"): ...``."""


@dataclass
class GroupUpdate:
    """One prompt group's local share, as the update hooks see it (lists are per micro-batch)."""

    index: int
    """The group's prompt slot (the first element of its unit keys)."""
    trajectories: list[Trajectory]
    """The rollout of each micro-batch."""
    rewards: list[torch.Tensor]
    """(B_mb,) local rewards."""
    group_mean: float
    """Mean reward of the whole group (all ranks), float64 precision."""
    advantages: Optional[list[torch.Tensor]] = None
    """(B_mb,) float32 clamped advantages (None until known)."""
    alpha: float = 0.0
    """Unclamped affine form A = alpha·r + gamma: alpha = 1 / (std + eps) (group or global std)."""
    gamma: float = 0.0
    """−mean·alpha."""
    clamp_fired: bool = False
    """Whether clamping changed any advantage of this group."""


class PhaseTimer:
    """Exclusive wall-clock time per phase; a nested phase pauses its parent's clock (the ``phase`` hook)."""

    def __init__(self, listener: Optional[Callable[[str, bool], None]] = None) -> None:
        """``listener(name, entering)`` is told of every phase entered and left (a memory simulation labels
        allocations by phase)."""
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []
        self.listener = listener

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block under ``name``."""
        now = time.perf_counter()
        if self._stack:
            self.totals[self._stack[-1][0]] += now - self._stack[-1][1]
        self._stack.append([name, now])
        if self.listener is not None:
            self.listener(name, True)
        try:
            yield
        finally:
            if self.listener is not None:
                self.listener(name, False)
            end = time.perf_counter()
            current = self._stack.pop()
            self.totals[name] += end - current[1]
            if self._stack:
                self._stack[-1][1] = end


def kl_value(sde: SDEParams, objective: Objective, mean: torch.Tensor, ref_mean: torch.Tensor,
             std: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """(B,) KL of the step to the reference in the configured form (gradient through ``mean``)."""
    # On a checked schedule (σ' < σ: SDEParams.check_schedule) std_t and s are positive for every kind but cps,
    # whose s = σ'·sin(aπ/2) is 0 at σ' = 0: only there does the KL read its std back to check it.
    check = sde.kind == "flow_grpo_cps"
    if objective.kl_form == "flow_grpo":
        return kl_loss(mean, ref_mean, std_t=sde.std_t(sigma, sigma_next), form="flow_grpo",
                       sample_mean=sde.sample_mean, check=check)
    return kl_loss(mean, ref_mean, transition_std=std, form="exact", sample_mean=sde.sample_mean, check=check)


def selected_rows(train: torch.Tensor) -> Optional[list[int]]:
    """The rows of the (B,) bool ``train`` mask, or None when every row trains. ``train`` is host data (the steps
    are selected before the rollout), so reading it costs no device sync."""
    rows = train.nonzero().flatten().tolist()
    return None if len(rows) == train.numel() else rows


def _masked_sum(per_sample: torch.Tensor, train: torch.Tensor, rows: Optional[list[int]]) -> torch.Tensor:
    """Σ of ``per_sample`` over the train rows: a select on the device (no boolean indexing, which syncs), or the
    plain sum when every row trains (the same bits: the select would pass every value through)."""
    if rows is None:
        return per_sample.sum()
    return torch.where(train.to(per_sample.device), per_sample, torch.zeros_like(per_sample)).sum()


def unit_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
              train: torch.Tensor, weight: float, objective: Objective,
              kl: Optional[torch.Tensor] = None,
              guard: Optional[GuardTerms] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss of the unit, ρ of its train rows) — the one loss definition of every schedule. ``train`` is a
    (B,) bool host tensor; the unit reads nothing back from the device. With ``guard`` (GRPO-Guard,
    docs/algorithms.md §9) ρ is RatioNorm's ρ̃ when ``objective.ratio_norm``, and each row's clipped surrogate is
    multiplied by its step's gradient weight (the KL term is not)."""
    if guard is None:
        per_sample, _ = grpo_step_loss(log_prob, old_log_prob, advantages, clip_range=objective.clip_range)
        ratio = torch.exp(log_prob.detach() - old_log_prob.detach())
    else:
        if objective.ratio_norm:
            log_ratio = ratio_norm_log_ratio(log_prob, old_log_prob, guard.mean, guard.old_mean, guard.std,
                                             sample_mean=guard.sample_mean)
        else:
            log_ratio = log_prob.float() - old_log_prob.detach().float()
        per_sample, ratio = clipped_surrogate(log_ratio, advantages, clip_range=objective.clip_range)
        ratio = ratio.detach()
        if guard.weight is not None:
            per_sample = per_sample * guard.weight
    if kl is not None:
        per_sample = per_sample + objective.kl_beta * kl
    rows = selected_rows(train)
    loss = _masked_sum(per_sample, train, rows) * weight
    if rows is not None:
        ratio = ratio.index_select(0, torch.tensor(rows, dtype=torch.long).to(ratio.device))
    return loss, ratio


def kl_unit_loss(kl: torch.Tensor, train: torch.Tensor, weight: float, objective: Objective) -> torch.Tensor:
    """The KL part alone, weighted like :func:`unit_loss` (Reweight backpropagates it unscaled)."""
    per_sample = objective.kl_beta * kl
    return _masked_sum(per_sample, train, selected_rows(train)) * weight


def pipelined(velocity_fn):
    """The velocity function's pipeline stages (:class:`~leangrpo_mcore.parallel.stages.StagedVelocity`), or None."""
    return velocity_fn if hasattr(velocity_fn, "scheduled") else None


class Schedule:
    """Base strategy: no-op hooks; subclasses implement the schedule-specific ones."""

    name = "base"
    recompute_free = False
    """Whether selected steps train from the rollout's own forwards (no recompute)."""
    pipelined_rollout = False
    """Whether, with pipeline stages, the rollout's grad-enabled forwards of a group's micro-batches may run
    together through megatron's forward-only schedule, their graphs kept (Retain)."""
    per_sample_grad = False
    """Whether the rollout runs each trained sample's grad-enabled forward alone (batch 1), handing
    :meth:`on_step` one row at a time (``StepRecord.row``)."""
    trains_rows = False
    """Whether, with pipeline stages, the trained rows of a denoising step of a group's micro-batches go to
    :meth:`train_rows` together (their forwards and immediate backwards pipelined: Reweight)."""

    def __init__(self, context: ScheduleContext) -> None:
        self.ctx = context
        self.weight = 0.0
        self.stats = UpdateStats(clip_range=context.objective.clip_range)

    def begin_update(self, weight: float) -> None:
        """Start an update whose unit losses are scaled by ``weight`` (:func:`loss_weight`)."""
        self.weight = float(weight)
        self.stats = UpdateStats(clip_range=self.ctx.objective.clip_range)

    def grad_steps(self, selected: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, T) steps whose rollout forward needs gradients (None: a no-grad rollout)."""
        return selected if self.recompute_free else None

    def on_step(self, key: UnitKey, conditioning: Conditioning) -> Optional[Callable[[StepRecord], None]]:
        """The sampler callback of micro-batch ``key`` (None: nothing to do during rollout)."""
        return None

    def train_rows(self, group: int, rows: list[TrainedRow]) -> list[torch.Tensor]:
        """Forward and backpropagate the trained rows of one denoising step of group ``group`` (``row.loop`` is the
        micro-batch), returning their detached velocities (:attr:`trains_rows` schedules only)."""
        raise NotImplementedError(f"schedule {self.name!r} does not train rows during the rollout")

    def on_rewards(self, key: UnitKey, rewards: torch.Tensor) -> None:
        """Local rewards of micro-batch ``key`` are known (right after its rollout)."""

    def on_group_rewards(self, group: GroupUpdate) -> None:
        """The group's rewards are gathered: ``group.group_mean`` is known, advantages maybe not yet."""

    def on_advantages(self, group: GroupUpdate) -> None:
        """``group.advantages`` are known: contribute the group's gradient."""

    def held_gradients(self) -> Iterator[torch.Tensor]:
        """Gradient tensors the schedule holds outside the parameters' ``.grad`` (none here)."""
        return iter(())

    def finish_update(self) -> UpdateStats:
        """Complete the update: every gradient reduced into the parameters' ``.grad``."""
        with self.ctx.phase("sync"):
            self.ctx.grad_sync.finish()
        return self.stats

    # ------------------------------------------------------------------ shared forward helpers
    def reference_mean(self, latents: torch.Tensor, next_latents: torch.Tensor, sigma: torch.Tensor,
                       sigma_next: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """The reference policy's SDE mean (adapters disabled, no grad) for the KL term."""
        with torch.no_grad(), self.ctx.velocity_fn.reference(), self.ctx.precision(False):
            velocity = self.ctx.velocity_fn(latents, sigma, conditioning)
            return self.ctx.sde.step(velocity, latents, sigma, sigma_next, prev_sample=next_latents).mean

    def reference_velocities(self, requests: list[tuple[torch.Tensor, torch.Tensor, Conditioning]]
                             ) -> list[torch.Tensor]:
        """The reference policy's velocities of several forwards (adapters disabled, no grad), with pipeline
        stages one forward-only call of megatron's schedule (one at a time, each would cross the stages alone)."""
        staged = pipelined(self.ctx.velocity_fn)
        with torch.no_grad(), self.ctx.velocity_fn.reference(), self.ctx.precision(False):
            if staged is not None:
                return staged.velocities(requests)
            return [self.ctx.velocity_fn(*request) for request in requests]

    def reference_means(self, steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                Conditioning]]) -> list[torch.Tensor]:
        """:meth:`reference_mean` of several steps ``(latents, next_latents, sigma, sigma_next, conditioning)``,
        their forwards together (:meth:`reference_velocities`)."""
        velocities = self.reference_velocities([(x, sigma, cond) for x, _, sigma, _, cond in steps])
        with torch.no_grad():
            return [self.ctx.sde.step(v, x, sigma, sigma_next, prev_sample=x_next).mean
                    for v, (x, x_next, sigma, sigma_next, _) in zip(velocities, steps)]

    def recompute(self, traj: Trajectory, t: int):
        """Native's forward of step ``t`` of micro-batch ``traj`` with gradients on the stored inputs."""
        latents, next_latents = traj.latents[:, t], traj.next_latents[:, t]
        sigma, sigma_next = traj.sigmas[:, t], traj.sigmas[:, t + 1]
        with torch.enable_grad(), self.ctx.precision(True):
            velocity = self.ctx.velocity_fn(latents, sigma, traj.conditioning)
            return self.ctx.sde.step(velocity, latents, sigma, sigma_next, prev_sample=next_latents)

    def step_kl(self, mean: torch.Tensor, std: torch.Tensor, latents: torch.Tensor, next_latents: torch.Tensor,
                sigma: torch.Tensor, sigma_next: torch.Tensor, conditioning: Conditioning) -> Optional[torch.Tensor]:
        """(B,) KL to the reference when β > 0, else None."""
        if self.ctx.objective.kl_beta == 0.0:
            return None
        ref = self.reference_mean(latents, next_latents, sigma, sigma_next, conditioning)
        return kl_value(self.ctx.sde, self.ctx.objective, mean, ref, std, sigma, sigma_next)
