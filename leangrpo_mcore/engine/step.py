"""One training step: prompts → rollout → reward → gather → advantages → update → sync → clip → optimizer.

Per prompt group held by this rank (``parallel.groups``) the rank rolls out its generations micro-batch by
micro-batch, scores them (``reward_fn``), gathers the group's rewards among the ranks that share it,
computes the advantages and lets the schedule produce the group's gradient right away (with global std
the advantages, and so every group's update, wait for the whole step's rewards). Then the gradients are
finished (reduced), clipped, and the optimizer steps.

``grpo.updates_per_rollout = K`` splits the step's prompt groups into K consecutive blocks, one optimizer
step each, the baselines' "K optimizer steps per rollout batch". Every block is rolled out before the first
optimizer step; the first block is updated by the configured schedule (recompute-free for Retain and
Reweight), the later ones by Native at the current parameters, since the rollout's graphs are stale by then.

``reward.async_scoring`` scores a group in the background while this rank rolls out its next group (and
updates the group before): each micro-batch goes to ``reward_fn.submit`` (a Future; a plain ``reward_fn`` is
called on a worker thread). The group's rewards are joined right after the next group's rollout, before the
schedule's ``on_rewards`` / ``on_group_rewards`` and before any advantage, and every hook runs in the order it
runs without it, so rewards, advantages and gradients are the same bit for bit. What grows is what the
schedule holds while it waits: the next group's trajectories, and Retain's graphs or Reweight's provisional
gradients of two groups instead of one. The ``reward`` phase is then the time spent waiting for the scores.

``parallel.cp`` (context parallelism): the CP ranks of a data-parallel index make the same samples, each holding
its piece of every latent (:mod:`leangrpo_mcore.parallel.sequence`); the velocity function gathers the pieces
for the sequence-parallel forward and keeps its piece of the output, the log-prob and KL reduce their partial
sums over the CP group, and the final latents are gathered and scored once per sample, on CP rank 0, whose
rewards every CP rank receives. Their gradients are partial and FSDP2's reduction over dp_shard · cp adds them.

``parallel.pp`` (pipeline parallelism): the stages of a data-parallel index run this same program in lock-step,
each holding its own blocks; only the policy forward is split (:mod:`leangrpo_mcore.parallel.stages`), and every
stage gets the same velocity, so the trajectories, rewards (scored on the last stage, received by the others),
advantages and schedule hooks are the same on every stage, and each stage's gradients are its own blocks'. With
both, the CP ranks of each stage split the samples' tokens, and a sample is scored on CP rank 0 of the last stage.

``reward.aggregate: advantages`` (:attr:`StepPlan.reward_weights`): ``reward_fn`` returns (B, K) component rewards,
which travel as the (B,) ones do (gathered per group and per step, broadcast from the scoring rank, joined from
the background); each component gets its own group advantage and A = clamp(Σ_k w_k A_k). The schedules' reward
hooks and the reported rewards see the weighted sum Σ_k w_k r_k.
"""

from __future__ import annotations

import dataclasses
import contextlib
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.config.schema import Config
from leangrpo_mcore.config.window_rules import is_ratio
from leangrpo_mcore.diffusion.sampler import (RolloutInputs, RolloutLoop, SDEParams, draw_rollout_inputs,
                                              rollout_together)
from leangrpo_mcore.diffusion.selection import check_selection, num_selected
from leangrpo_mcore.diffusion.trajectory import Conditioning, Trajectory
from leangrpo_mcore.diffusion.sigmas import SigmaSpec
from leangrpo_mcore.diffusion.window import SDEWindow, optimizer_steps_before, rollout_schedule
from leangrpo_mcore.engine.optim import clip_grad_norm_, optimizer_step, trainable_parameters
from leangrpo_mcore.parallel.fsdp import StepGathering, reshard_policy
from leangrpo_mcore.parallel.gathering import ReshardValue, gather_mode, selection_varies_across_ranks
from leangrpo_mcore.parallel.grad_sync import GradSync
from leangrpo_mcore.parallel.groups import (PromptShare, assign_samples, build_group_process_groups, check_layout,
                                            check_updates, gather_group_rewards, gather_step_rewards)
from leangrpo_mcore.parallel.memory import MemoryMeter
from leangrpo_mcore.parallel.mesh import ParallelContext
from leangrpo_mcore.parallel.precision import ForwardPrecision, null_precision
from leangrpo_mcore.parallel.sequence import LatentSplit
from leangrpo_mcore.parallel.stages import split_velocity
from leangrpo_mcore.rl.advantages import advantage_affine, clamp_would_fire, compute_advantages, weighted_sum
from leangrpo_mcore.schedules.base import (GroupUpdate, Objective, PhaseTimer, ScheduleContext, UpdateStats,
                                           build_schedule, loss_weight)
from leangrpo_mcore.schedules.reweight import ReweightPlan, plan_reweight

RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``reward_fn(final_latents (B, *shape), prompt_ids (B,)) -> (B,)`` float rewards, (B, K) component rewards with
:attr:`StepPlan.reward_weights` (with async scoring, ``reward_fn.submit`` with the same arguments returns a Future
of them, where it has one)."""
ProgressFn = Callable[[int, int], None]
"""``progress(done, total)``: after each denoising step of the rollout, how many of the step's ``total``
denoising steps (steps × this rank's micro-batches over its groups) are done."""


@dataclass(frozen=True)
class StepPlan:
    """The resolved settings of a training step; :meth:`validate` refuses anything that cannot be exact."""

    schedule: str
    """Schedule of the first update: native, retain or reweight."""
    group_size: int
    """M, generations per prompt."""
    prompts_per_step: int
    """P, prompt groups per step over all ranks."""
    latent_shape: tuple[int, ...]
    """Shape of one sampler latent (FLUX: packed tokens × channels; Wan: C, F, H, W)."""
    sigmas: torch.Tensor
    """(T+1,) float32 sigma schedule."""
    sde: SDEParams
    """SDE variant and constants."""
    objective: Objective
    """Clip range and KL settings."""
    selection: dict
    """select_steps settings: method, fraction, window_size, window_range."""
    advantage: str = "flow_grpo"
    """Advantage estimator name."""
    adv_clip_max: Optional[float] = 5.0
    """Advantage clamp (None: none)."""
    global_std: bool = False
    """Normalise advantages by the std of the whole step's rewards."""
    layout: str = "shared"
    """Data-parallel layout of the samples (parallel.groups)."""
    micro_batch: int = 1
    """Samples per policy forward."""
    updates_per_rollout: int = 1
    """Optimizer steps per rollout (blocks of prompt groups)."""
    sync: Optional[str] = None
    """Gradient sync of Native/Retain: per_backward, coalesced, or None (Native per backward, Retain coalesced)."""
    reweight_accumulate: str = "per_sample"
    """Reweight's provisional-gradient accumulation: per_sample or affine."""
    provisional_dtype: Optional[str] = None
    """Reweight's provisional-gradient dtype (None: as the backward leaves them)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: off)."""
    seed: int = 0
    """train.seed: every random draw derives from it."""
    same_latent: bool = False
    """Share the initial noise within a prompt group."""
    reshard_after_forward: ReshardValue = "auto"
    """parallel.reshard_after_forward: true, false, "rollout", or an unresolved auto (see :func:`gather_mode`)."""
    async_scoring: bool = False
    """reward.async_scoring: score each group in the background during the next group's rollout."""
    reward_weights: Optional[tuple[float, ...]] = None
    """reward.aggregate=advantages: the weights w_k of the K component rewards ``reward_fn`` returns as (B, K),
    each normalised into its own group advantage, A = clamp(Σ_k w_k A_k). None: (B,) rewards, one advantage."""
    window: Optional[SDEWindow] = None
    """Where the SDE window sits and the compression after it, with ``selection``'s size and range (None:
    FlowGRPO-Fast's random window per prompt group)."""
    ode_solver: str = "euler"
    """Solver of the ODE steps outside the SDE window: euler or dpmpp_2m."""
    ode_before_window: str = "same"
    """sampler.ode_solver_before_window: same (``ode_solver``) or euler before a row's SDE window."""
    sigma_spec: Optional[SigmaSpec] = None
    """The formula of ``sigmas`` (re-spaces the tail after the window for a ratio of steps; None: no ratio)."""

    @classmethod
    def from_config(cls, cfg: Config, *, latent_shape: tuple[int, ...], sigmas: torch.Tensor,
                    schedule: Optional[str] = None, sigma_spec: Optional[SigmaSpec] = None) -> "StepPlan":
        """From a :class:`Config` (``schedule`` overrides ``cfg.schedule.name``, e.g. after the planner;
        ``sigma_spec`` the formula of ``sigmas``)."""
        s, g = cfg.sampler, cfg.grpo
        window = s.sde_window_size
        return cls(
            schedule=schedule or cfg.schedule.name, group_size=g.group_size, prompts_per_step=g.prompts_per_step,
            latent_shape=tuple(latent_shape), sigmas=sigmas.to(torch.float32),
            sde=SDEParams.from_sigmas(s.sde_kind, s.noise_level, sigmas),
            objective=Objective(clip_range=g.clip_range, kl_beta=g.kl_beta, kl_form=g.kl_form,
                                ratio_norm=g.ratio_norm, grad_reweight=g.grad_reweight),
            selection={"method": g.timestep_selection, "fraction": g.timestep_fraction, "window_size": window,
                       "window_range": tuple(s.sde_window_range)},
            advantage=g.advantage, adv_clip_max=g.adv_clip_max, global_std=g.global_std,
            layout=cfg.parallel.layout, micro_batch=cfg.schedule.micro_batch,
            updates_per_rollout=g.updates_per_rollout, sync="coalesced" if cfg.schedule.coalesce_sync else None,
            reweight_accumulate=cfg.schedule.reweight_accumulate, max_grad_norm=cfg.optim.max_grad_norm,
            provisional_dtype=cfg.schedule.provisional_dtype or cfg.parallel.reduce_dtype,
            seed=cfg.train.seed, same_latent=s.same_latent,
            reshard_after_forward=cfg.parallel.reshard_after_forward, async_scoring=cfg.reward.async_scoring,
            reward_weights=(tuple(float(w) for w in (cfg.reward.weights or {}).values())
                            if cfg.reward.aggregate == "advantages" else None),
            window=SDEWindow(size=window, low=int(s.sde_window_range[0]), high=int(s.sde_window_range[-1]),
                             schedule=s.sde_window_schedule, stride=s.window_stride,
                             shift_every=s.window_shift_every, ode_steps_after=s.ode_steps_after_window or 0),
            ode_solver=s.ode_solver, ode_before_window=s.ode_solver_before_window, sigma_spec=sigma_spec,
        )

    @property
    def sde_window(self) -> SDEWindow:
        """The SDE window settings (:attr:`window`, or a random window of ``selection``'s size and range)."""
        if self.window is not None:
            return self.window
        bounds = self.selection.get("window_range", (0, 1))
        return SDEWindow(size=self.selection.get("window_size", 0), low=int(bounds[0]), high=int(bounds[-1]))

    def window_start(self, step: int) -> Optional[int]:
        """The start of training step ``step``'s shared SDE window (None: drawn per prompt group, or no window):
        a function of the optimizer steps before it, so a resumed run continues where it stopped."""
        return self.sde_window.start(optimizer_steps_before(step, self.updates_per_rollout))

    def rollout_sigmas(self, window_start: Optional[int]) -> torch.Tensor:
        """The (T'+1,) float32 sigmas of a rollout whose shared window starts at ``window_start``: the schedule,
        with the steps after the window compressed when ``sampler.ode_steps_after_window`` is set."""
        w = self.sde_window
        if window_start is None or not w.ode_steps_after:
            return self.sigmas
        return rollout_schedule(self.sigmas, window_start + w.size, w.ode_steps_after, self.sigma_spec)

    @property
    def components(self) -> int:
        """K, the component rewards per sample (0: one (B,) reward)."""
        return len(self.reward_weights) if self.reward_weights is not None else 0

    def total(self, rewards: torch.Tensor) -> torch.Tensor:
        """The reward the schedules and the logs see: ``rewards`` itself, or Σ_k w_k r_k of (..., K) components."""
        return rewards if self.reward_weights is None else weighted_sum(rewards, self.reward_weights)

    @property
    def num_steps(self) -> int:
        """T."""
        return self.sigmas.numel() - 1

    @property
    def steps_per_sample(self) -> int:
        """|S| (the same for every sample)."""
        sel = self.selection
        return num_selected(sel["method"], self.num_steps, sel["fraction"], sel.get("window_size", 0))

    @property
    def samples_per_update(self) -> int:
        """Samples of one update over all ranks."""
        return self.prompts_per_step // self.updates_per_rollout * self.group_size

    def update_of(self, slot: int) -> int:
        """Which optimizer step of the rollout trains prompt ``slot``."""
        return slot * self.updates_per_rollout // self.prompts_per_step

    def sync_mode(self) -> str:
        """Sync of this step's updates: Reweight always coalesces (it must scale before reducing); Native
        syncs per backward like the baselines and Retain once per update, unless ``sync`` says otherwise."""
        if self.schedule == "reweight":
            return "coalesced"
        if self.sync is not None:
            return self.sync
        return "per_backward" if self.schedule == "native" else "coalesced"

    def reweight_plan(self) -> ReweightPlan:
        """The exact accumulation Reweight uses for these settings."""
        plan = plan_reweight(self.reweight_accumulate, advantage=self.advantage, group_size=self.group_size,
                             prompts_per_step=self.prompts_per_step, adv_clip_max=self.adv_clip_max,
                             global_std=self.global_std,
                             aggregate="rewards" if self.reward_weights is None else "advantages")
        return dataclasses.replace(plan, provisional_dtype=self.provisional_dtype)

    def selection_varies(self, ctx: ParallelContext) -> bool:
        """Whether the data-parallel ranks train different steps in one round."""
        if self.sde_window.shared:
            return False
        return selection_varies_across_ranks(self.selection["method"], layout=self.layout,
                                             group_size=self.group_size, dp_size=ctx.dp_size)

    def gather_mode(self, ctx: ParallelContext) -> str:
        """How FSDP2 gathers the parameters in a step: forward, rollout or step
        (:mod:`leangrpo_mcore.parallel.gathering`)."""
        return gather_mode(self.reshard_after_forward, schedule=self.schedule, varies=self.selection_varies(ctx))

    def schedule_options(self, name: str) -> dict:
        """Constructor options of schedule ``name``."""
        return {"plan": self.reweight_plan()} if name == "reweight" else {}

    def validate(self, ctx: ParallelContext, policy: torch.nn.Module) -> None:
        """One-line ValueError for settings that are inconsistent or could not be computed exactly."""
        sel = self.selection
        if self.sync not in (None, "per_backward", "coalesced"):
            raise ValueError(f"unknown gradient sync {self.sync!r}; valid: per_backward, coalesced")
        if self.schedule == "auto":
            raise ValueError("schedule 'auto' must be resolved by the planner before building the step engine")
        if (sel["method"] == "sde_window") != (sel.get("window_size", 0) > 0):
            raise ValueError("sampler.sde_window_size > 0 goes with grpo.timestep_selection=sde_window (and only)")
        check_selection(sel["method"], self.num_steps, sel["fraction"], sel.get("window_size", 0),
                        sel.get("window_range", (0, 1)))
        window = self.sde_window
        window.check(self.num_steps, self.ode_solver, self.ode_before_window)
        if is_ratio(window.ode_steps_after) and self.sigma_spec is None:
            raise ValueError("sampler.ode_steps_after_window as a ratio re-spaces the schedule after the window: the "
                             "plan needs the schedule's formula (sigma_spec)")
        bounds = sel.get("window_range", (0, 1))
        if (window.size, window.low, window.high) != (sel.get("window_size", 0), int(bounds[0]), int(bounds[-1])):
            raise ValueError("the plan's window and its selection disagree on the window's size or range")
        check_layout(self.layout, ctx.dp_size, self.group_size, self.prompts_per_step)
        if ctx.layout.cp > 1 and self.async_scoring:
            raise ValueError("reward.async_scoring with parallel.cp > 1 is not supported yet: set one of them off")
        if ctx.layout.pp > 1 and self.async_scoring:
            raise ValueError("reward.async_scoring with parallel.pp > 1 is not supported yet: set one of them off")
        if (self.schedule == "reweight" and self.gather_mode(ctx) == "forward" and int(ctx.layout.dp_shard) > 1
                and self.selection_varies(ctx)):
            raise ValueError(f"Reweight with {sel['method']} selection trains different steps on different ranks: "
                             "its immediate backwards cannot regather FSDP2 blocks in step; set "
                             "parallel.reshard_after_forward=false, rollout or auto")
        if sel["method"] == "dance_grpo" and self.micro_batch > 1:
            raise ValueError("dance_grpo selection trains different steps per sample: use schedule.micro_batch=1")
        if self.prompts_per_step % self.updates_per_rollout:
            raise ValueError(f"grpo.updates_per_rollout ({self.updates_per_rollout}) must divide "
                             f"grpo.prompts_per_step ({self.prompts_per_step}): each update trains whole groups")
        check_updates(self.layout, ctx.dp_size, self.group_size, self.prompts_per_step, self.updates_per_rollout)
        if self.reward_weights is not None and (not self.reward_weights
                                                or not all(math.isfinite(w) for w in self.reward_weights)):
            raise ValueError(f"reward.aggregate=advantages needs finite reward weights, got {self.reward_weights}")
        if self.advantage == "dance_grpo" and self.group_size < 2:
            raise ValueError("dance_grpo advantages use an unbiased std: grpo.group_size must be >= 2")
        if self.objective.kl_beta > 0:
            from leangrpo_mcore.models.common.lora import iter_lora_hosts

            if next(iter_lora_hosts(policy), None) is None:
                raise ValueError("grpo.kl_beta > 0 needs LoRA: the KL reference is the policy with its adapters "
                                 "disabled (set model.lora.rank > 0)")


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


def _check_rewards(rewards: torch.Tensor, batch: int, components: int = 0) -> torch.Tensor:
    """``rewards`` as float32 of shape (batch,), or (batch, components) for component rewards; ValueError else."""
    rewards = torch.as_tensor(rewards)
    shape = (batch, components) if components else (batch,)
    if rewards.shape != shape:
        raise ValueError(f"reward_fn must return shape {shape}, got {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"reward_fn returned {int((~torch.isfinite(rewards)).sum())} non-finite rewards")
    return rewards.detach().to(torch.float32)


class StepEngine:
    """Runs training steps of one policy with one schedule (see module docstring)."""

    def __init__(self, plan: StepPlan, *, policy: torch.nn.Module, velocity_fn, ctx: ParallelContext,
                 optimizer: torch.optim.Optimizer, reward_fn: RewardFn, lr_scheduler=None,
                 precision: ForwardPrecision = null_precision, measure_memory: Optional[bool] = None,
                 keep_trajectories: bool = False, progress: Optional[ProgressFn] = None) -> None:
        plan.validate(ctx, policy)
        self.split = LatentSplit(plan.latent_shape, ctx.cp_group) if ctx.layout.cp > 1 else None
        if self.split is not None:
            velocity_fn = split_velocity(velocity_fn, self.split)
            plan = dataclasses.replace(plan, sde=dataclasses.replace(plan.sde, sample_mean=self.split.sample_mean))
        self.plan, self.policy, self.velocity_fn, self.ctx = plan, policy, velocity_fn, ctx
        self.optimizer, self.reward_fn, self.lr_scheduler = optimizer, reward_fn, lr_scheduler
        self.precision = precision
        self.params = trainable_parameters(policy)
        self.measure_memory = ctx.device.type == "cuda" if measure_memory is None else measure_memory
        self.keep_trajectories = keep_trajectories
        self.progress, self._rolled = progress, 0
        self.shares = assign_samples(plan.layout, ctx.dp_rank, ctx.dp_size, plan.group_size, plan.prompts_per_step)
        self.gather_groups = (build_group_process_groups(plan.layout, ctx.dp_size, plan.group_size,
                                                         ctx.all_dp_global_ranks) if ctx.dp_size > 1 else {})
        self._scorer: Optional[ThreadPoolExecutor] = None
        self.active_schedule = None
        """The schedule of the update in progress (or last run)."""
        self.gathering: Optional[StepGathering] = None
        """The FSDP2 gathering of the step in progress (set when a step starts)."""
        self.phase_listener: Optional[Callable[[str, bool], None]] = None
        """Told of every phase of a step entered and left (see :class:`PhaseTimer`)."""

    def _schedule(self, name: str, timer: PhaseTimer):
        sync = GradSync(self.policy, self.ctx, mode=self.plan.sync_mode(), phase=timer.phase)
        context = ScheduleContext(velocity_fn=self.velocity_fn, sde=self.plan.sde, objective=self.plan.objective,
                                  grad_sync=sync, precision=self.precision, phase=timer.phase)
        return build_schedule(name, context, **self.plan.schedule_options(name))

    def step(self, inputs: StepInputs) -> StepResult:
        """Run one step (one rollout, ``updates_per_rollout`` optimizer steps)."""
        if inputs.conditioning.num_samples != self.plan.prompts_per_step:
            raise ValueError(f"step inputs have {inputs.conditioning.num_samples} prompts, "
                             f"expected prompts_per_step={self.plan.prompts_per_step}")
        meter = MemoryMeter(self.ctx.device) if self.measure_memory else contextlib.nullcontext()
        timer = PhaseTimer(self.phase_listener)
        self._rolled = 0
        with meter:
            result = self._run(inputs, timer)
        result.timings = dict(timer.totals)
        result.peak_memory_bytes = meter.peak_bytes if self.measure_memory else None
        return result

    def _run(self, inputs: StepInputs, timer: PhaseTimer) -> StepResult:
        plan = self.plan
        link = getattr(self.velocity_fn, "link", None)
        if link is not None:  # pipeline stages: the waits for other stages are timed in this step
            link.phase = timer.phase
        self.gathering = StepGathering(self.policy, plan.gather_mode(self.ctx))
        first = self._schedule(plan.schedule, timer)
        self.active_schedule = first
        first.begin_update(loss_weight(plan.samples_per_update, plan.steps_per_sample))
        records: list[GroupRecord] = []
        for record, schedule in self._scored_groups(inputs, first, timer):
            self.gathering.update()
            if schedule is not None:
                schedule.on_group_rewards(record.update)
            if not plan.global_std:
                with timer.phase("advantage"):
                    self._set_advantages([record], record.group_rewards,
                                         torch.zeros(plan.group_size, dtype=torch.long), [0])
                if schedule is not None:
                    schedule.on_advantages(record.update)
            records.append(record)
        table, advantages = self._step_advantages(records, timer)
        if plan.global_std:
            for record in records:
                if plan.update_of(record.share.prompt_slot) == 0:
                    first.on_advantages(record.update)
        updates = [self._finish(first, timer)]
        for k in range(1, plan.updates_per_rollout):
            native = self._schedule("native", timer)
            self.active_schedule = native
            native.begin_update(loss_weight(plan.samples_per_update, plan.steps_per_sample))
            for record in records:
                if plan.update_of(record.share.prompt_slot) == k:
                    native.on_advantages(record.update)
            updates.append(self._finish(native, timer))
        kept = {r.share.prompt_slot: r.update.trajectories for r in records} if self.keep_trajectories else {}
        return StepResult(step=inputs.step, rewards=plan.total(table), advantages=advantages, updates=updates,
                          trajectories=kept, component_rewards=table if plan.components else None,
                          window_start=plan.window_start(inputs.step))

    def _scored_groups(self, inputs: StepInputs, first, timer: PhaseTimer) -> Iterator[tuple[GroupRecord, object]]:
        """This rank's groups in update order with their rewards gathered, each with its schedule (None: a later
        update's). With async scoring a group is handed on after the next group's rollout, the background
        scoring of the one overlapping the other (and the update of the group handed on before)."""
        plan = self.plan
        scoring = None
        for share in sorted(self.shares, key=lambda s: (plan.update_of(s.prompt_slot), s.prompt_slot)):
            schedule = first if plan.update_of(share.prompt_slot) == 0 else None
            self.gathering.rollout()
            group = self._roll_out_group(inputs, share, schedule, timer)
            if not plan.async_scoring:
                yield group, schedule
                continue
            if scoring is not None:
                yield self._join_group(*scoring, timer), scoring[1]
            scoring = (group, schedule)
        if scoring is not None:
            yield self._join_group(*scoring, timer), scoring[1]

    def _submit(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> Future:
        """A Future of ``reward_fn``'s rewards: its own ``submit`` where it has one, else a worker thread."""
        submit = getattr(self.reward_fn, "submit", None)
        if callable(submit):
            return submit(final_latents, prompt_ids)
        if self._scorer is None:
            self._scorer = ThreadPoolExecutor(1, thread_name_prefix="reward")
        return self._scorer.submit(self.reward_fn, final_latents, prompt_ids)

    def _join_group(self, group: ScoringGroup, schedule, timer: PhaseTimer) -> GroupRecord:
        """Wait for a group's rewards, micro-batch by micro-batch, and gather them (async scoring)."""
        rewards = []
        for mb, (traj, score) in enumerate(zip(group.trajectories, group.scores)):
            with timer.phase("reward"):
                local = _check_rewards(score.result(), traj.final_latents.shape[0], self.plan.components)
            if schedule is not None:
                schedule.on_rewards((group.share.prompt_slot, mb), self.plan.total(local))
            rewards.append(local)
        return self._gathered(group.share, group.trajectories, rewards, timer)

    def _roll_out_group(self, inputs: StepInputs, share: PromptShare, schedule,
                        timer: PhaseTimer) -> GroupRecord | ScoringGroup:
        """Roll out and score this rank's generations of one prompt, micro-batch by micro-batch (with async
        scoring: roll out, and submit each micro-batch for scoring). With pipeline stages a rollout without
        gradients runs all the micro-batches together (their forwards pipelined over the stages), then scores."""
        plan = self.plan
        gens = list(share.generation_ids)
        batches = [gens[start:start + plan.micro_batch] for start in range(0, len(gens), plan.micro_batch)]
        many = getattr(self.velocity_fn, "velocities", None)
        # Retain's trained steps go through the stages together too (their graphs kept), and so do Reweight's trained
        # rows (each forward and its immediate backward one micro-batch of a 1F1B schedule)
        keeps = schedule is not None and schedule.pipelined_rollout
        rows = schedule is not None and schedule.trains_rows
        together = many is not None and (schedule is None or not schedule.recompute_free or keeps or rows)
        loops = {}
        if together:  # pipeline stages: the micro-batches flow through the stages step after step
            loops = {mb: self._rollout_loop(inputs, share, mb, ids, schedule) for mb, ids in enumerate(batches)}
            train_rows = (lambda trained: schedule.train_rows(share.prompt_slot, trained)) if rows else None
            with timer.phase("rollout"):
                rollout_together([loop for loop, _ in loops.values()], self.velocity_fn, many, with_grad=keeps,
                                 train_rows=train_rows)
        trajectories, rewards = [], []
        for mb, batch in enumerate(batches):
            loop, ids = loops.pop(mb) if together else self._rollout_loop(inputs, share, mb, batch, schedule)
            if not together:
                with timer.phase("rollout"):
                    while not loop.done:
                        loop.step(self.velocity_fn)
            trajectories.append(loop.trajectory())
            if plan.async_scoring:
                rewards.append(self._submit(trajectories[-1].final_latents, ids))
                continue
            with timer.phase("reward"):
                local = self._score(trajectories[-1].final_latents, ids)
            if schedule is not None:
                schedule.on_rewards((share.prompt_slot, mb), plan.total(local))
            rewards.append(local)
        if plan.async_scoring:
            return ScoringGroup(share=share, trajectories=trajectories, scores=rewards)
        return self._gathered(share, trajectories, rewards, timer)

    def _rollout_loop(self, inputs: StepInputs, share: PromptShare, mb: int, ids: list[int],
                      schedule) -> tuple[RolloutLoop, torch.Tensor]:
        """(the denoising loop of micro-batch ``mb`` of generations ``ids``, its prompt ids), its inputs drawn."""
        plan, device = self.plan, self.ctx.device
        slots = [share.prompt_slot] * len(ids)
        sigmas, draws = self._draw(inputs.step, slots, ids)
        cond = inputs.conditioning.select(slots).to(device)
        prompt_ids = inputs.prompt_ids[torch.tensor(slots, dtype=torch.long)]
        loop = RolloutLoop(draws.init_latents, sigmas, cond, sde=plan.sde, selected=draws.selected,
                           sde_steps=draws.sde_steps, noise_seeds=draws.noise_seeds, prompt_ids=prompt_ids,
                           generation_ids=torch.tensor(ids, dtype=torch.long),
                           grad_steps=None if schedule is None else schedule.grad_steps(draws.selected),
                           on_step=self._with_progress(None if schedule is None
                                                       else schedule.on_step((share.prompt_slot, mb), cond),
                                                       sigmas.numel() - 1),
                           forward_context=self.precision, split=self.split,
                           per_sample_grad=schedule is not None and schedule.per_sample_grad, ode_solver=plan.ode_solver,
                           ode_before_window=plan.ode_before_window, keep_means=plan.objective.ratio_norm)
        return loop, prompt_ids

    def _draw(self, step: int, slots: list[int], ids: list[int]) -> tuple[torch.Tensor, RolloutInputs]:
        """(the (T'+1,) sigmas, the seeded inputs) of generations ``ids`` of prompt ``slots`` at training ``step``:
        the step's shared window placed, and a rollout compressed after it cut to its T' steps (it is the full
        rollout up to the window's end, so the first steps' selection and seeds are the full one's)."""
        plan = self.plan
        start = plan.window_start(step)
        draws = draw_rollout_inputs(base_seed=plan.seed, step=step, prompt_slots=slots, generation_ids=ids,
                                    latent_shape=plan.latent_shape, num_steps=plan.num_steps,
                                    selection={**plan.selection, "window_start": start}, same_latent=plan.same_latent,
                                    device=self.ctx.device)
        sigmas = plan.rollout_sigmas(start)
        steps = sigmas.numel() - 1
        if steps < plan.num_steps:
            draws = RolloutInputs(init_latents=draws.init_latents, selected=draws.selected[:, :steps],
                                  sde_steps=draws.sde_steps[:, :steps], noise_seeds=draws.noise_seeds[:, :steps])
        return sigmas, draws

    def _score(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
        """(B,) checked rewards of a micro-batch, scored once per sample: under CP the whole latents on CP rank 0,
        under PP on the last stage (every stage holds the same latents), under both on CP rank 0 of the last
        stage; the other ranks of the sample receive the result (or the error)."""
        batch, components = final_latents.shape[0], self.plan.components
        # the scorer's result travels along its pipeline (from the last stage), then across the CP ranks of each stage
        hops = [(self.ctx.pp_group, int(self.ctx.layout.pp) - 1)] if self.ctx.pp_group is not None else []
        hops += [(self.ctx.cp_group, 0)] if self.split is not None else []
        if not hops:
            return _check_rewards(self.reward_fn(final_latents, prompt_ids), batch, components)
        whole = self.split.gather(final_latents) if self.split is not None else final_latents
        outcome: list = [None]
        if all(dist.get_rank(group) == src for group, src in hops):
            try:
                outcome[0] = _check_rewards(self.reward_fn(whole, prompt_ids), batch, components).cpu()
            except ValueError as err:
                outcome[0] = str(err)
        for group, src in hops:
            dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, src), group=group)
        if isinstance(outcome[0], str):
            raise ValueError(outcome[0])
        return outcome[0]

    def _gathered(self, share: PromptShare, trajectories: list[Trajectory], rewards: list[torch.Tensor],
                  timer: PhaseTimer) -> GroupRecord:
        """The group's record once this rank's rewards are known: the whole group's rewards gathered."""
        plan, device = self.plan, self.ctx.device
        with timer.phase("reward"):
            group = gather_group_rewards(torch.cat(rewards).to(device), share, plan.group_size,
                                         self.gather_groups.get(share.group_ranks))
        totals = [plan.total(r) for r in rewards]
        update = GroupUpdate(index=share.prompt_slot, trajectories=trajectories, rewards=totals,
                             group_mean=float(plan.total(group).double().mean()))
        return GroupRecord(share=share, update=update, group_rewards=group)

    def _with_progress(self, on_step, num_steps: int):
        """``on_step`` (or nothing) followed by a :attr:`progress` tick; ``on_step`` itself without a hook
        (``num_steps``: the denoising steps of each rollout of the step)."""
        if self.progress is None:
            return on_step
        plan = self.plan
        total = num_steps * sum(-(-len(s.generation_ids) // plan.micro_batch) for s in self.shares)

        def tick(record) -> None:
            if on_step is not None:
                on_step(record)
            if record.row is not None:
                return  # one sample of a per-sample step: the step's own record follows
            self._rolled += 1
            self.progress(self._rolled, total)
        return tick

    def _set_advantages(self, records: list[GroupRecord], rewards: torch.Tensor, group_ids: torch.Tensor,
                        offsets: list[int]) -> None:
        """Advantages of ``rewards`` (N,) (or (N, K) components) grouped by ``group_ids``; record n reads M entries
        from ``offsets[n]``."""
        plan = self.plan
        clamped = compute_advantages(plan.advantage, rewards, group_ids, adv_clip_max=plan.adv_clip_max,
                                     global_std=plan.global_std, weights=plan.reward_weights)
        raw = compute_advantages(plan.advantage, rewards, group_ids, adv_clip_max=None, global_std=plan.global_std,
                                 weights=plan.reward_weights)
        if plan.reward_weights is None:
            alpha, gamma = advantage_affine(plan.advantage, rewards, group_ids, global_std=plan.global_std)
        else:  # Σ_k w_k A_k is no affine function of one reward: plan_reweight keeps Reweight per-sample
            alpha = gamma = torch.full((rewards.shape[0],), math.nan, dtype=torch.float64)
        for record, offset in zip(records, offsets):
            rows = slice(offset, offset + plan.group_size)
            group_adv = clamped[rows]
            update = record.update
            update.advantages = [group_adv[traj.generation_ids.cpu()] for traj in update.trajectories]
            update.alpha, update.gamma = float(alpha[rows][0]), float(gamma[rows][0])
            update.clamp_fired = clamp_would_fire(raw[rows], plan.adv_clip_max)

    def _step_advantages(self, records: list[GroupRecord], timer: PhaseTimer) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, M) rewards ((P, M, K) component rewards) and (P, M) advantages of the step; with global std also each
        record's advantages."""
        plan = self.plan
        with timer.phase("reward"):
            local = {(r.share.prompt_slot, gen): reward for r in records
                     for gen, reward in enumerate(r.group_rewards.tolist()) if gen in r.share.generation_ids}
            table = gather_step_rewards(local, plan.prompts_per_step, plan.group_size, self.ctx.dp_group,
                                        self.ctx.device, components=plan.components)
        ids = torch.arange(plan.prompts_per_step).repeat_interleave(plan.group_size)
        flat = table.reshape(ids.numel(), *table.shape[2:])
        with timer.phase("advantage"):
            if plan.global_std:
                self._set_advantages(records, flat, ids, [r.share.prompt_slot * plan.group_size for r in records])
            advantages = compute_advantages(plan.advantage, flat, ids, adv_clip_max=plan.adv_clip_max,
                                            global_std=plan.global_std, weights=plan.reward_weights)
        return table, advantages.view(plan.prompts_per_step, plan.group_size)

    def _finish(self, schedule, timer: PhaseTimer) -> UpdateResult:
        """Finish the schedule's update, clip, step the optimizer; statistics over the ranks."""
        self.gathering.update()
        stats: UpdateStats = schedule.finish_update()
        reshard_policy(self.policy)  # gathered parameters would be stale after the optimizer step
        with timer.phase("clip"):
            norm, clipped = clip_grad_norm_(self.params, self.plan.max_grad_norm, self.ctx)
        with timer.phase("optimizer"):
            optimizer_step(self.optimizer, self.params, self.lr_scheduler)
        totals = stats.reduced(self.ctx.dp_group, self.ctx.device, self.plan.num_steps)
        if self.ctx.pp_group is not None:  # the losses and ratios are the last stage's (megatron's 1F1B)
            shared = [totals]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(self.ctx.pp_group, self.ctx.layout.pp - 1),
                                       group=self.ctx.pp_group)
            totals = shared[0]
        return UpdateResult(schedule=schedule.name, loss=totals["loss"], grad_norm=norm, clipped=clipped,
                            ratio_min=totals["ratio_min"], ratio_max=totals["ratio_max"],
                            ratio_mean=totals["ratio_mean"], clip_fraction=totals["clip_fraction"],
                            max_local_grad_buffers=stats.max_local_grad_buffers, per_step=totals["per_step"])
