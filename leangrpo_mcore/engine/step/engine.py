"""One training step: prompts → rollout → reward → gather → advantages → update → sync → clip → optimizer.

Per prompt group held by this rank (``parallel.groups``) the rank rolls out its generations micro-batch by
micro-batch (:mod:`~leangrpo_mcore.engine.step.rollout`), scores them (``reward_fn``), gathers the group's rewards
among the ranks that share it (:mod:`~leangrpo_mcore.engine.step.reward_join`), computes the advantages and lets
the schedule produce the group's gradient right away (with global std the advantages, and so every group's update,
wait for the whole step's rewards). Then the gradients are finished (reduced), clipped, and the optimizer steps.

``grpo.updates_per_rollout = K`` splits the step's prompt groups into K consecutive blocks, one optimizer
step each, the baselines' "K optimizer steps per rollout batch". Every block is rolled out before the first
optimizer step; the first block is updated by the configured schedule (recompute-free for Retain and
Reweight), the later ones by Native at the current parameters, since the rollout's graphs are stale by then.

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

import contextlib
import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.engine.optim import clip_grad_norm_, optimizer_step, trainable_parameters
from leangrpo_mcore.engine.step.plan import StepPlan
from leangrpo_mcore.engine.step.records import (GroupRecord, ProgressFn, RewardFn, StepInputs, StepResult,
                                                UpdateResult)
from leangrpo_mcore.engine.step.reward_join import RewardJoin
from leangrpo_mcore.engine.step.rollout import GroupRollout
from leangrpo_mcore.parallel.fsdp import StepGathering, reshard_policy
from leangrpo_mcore.parallel.grad_sync import GradSync
from leangrpo_mcore.parallel.groups import assign_samples, build_group_process_groups, gather_step_rewards
from leangrpo_mcore.parallel.memory import MemoryMeter
from leangrpo_mcore.parallel.mesh import ParallelContext
from leangrpo_mcore.parallel.precision import ForwardPrecision, null_precision
from leangrpo_mcore.parallel.sequence import LatentSplit
from leangrpo_mcore.parallel.stages import split_velocity
from leangrpo_mcore.rl.advantages import advantage_affine, clamp_would_fire, compute_advantages
from leangrpo_mcore.schedules.base import PhaseTimer, ScheduleContext, UpdateStats, build_schedule, loss_weight


class StepEngine(GroupRollout, RewardJoin):
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
        sync = GradSync(self.policy, self.ctx, mode=self.plan.sync_mode(), phase=timer.phase,
                        dense=self.plan.experts is not None)
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
