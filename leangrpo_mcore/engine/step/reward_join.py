"""The reward join of the step engine: each micro-batch scored (once per sample), its rewards gathered among the
ranks that share its prompt group, synchronously or joined from the background.

``reward.async_scoring`` scores a group in the background while this rank rolls out its next group (and
updates the group before): each micro-batch goes to ``reward_fn.submit`` (a Future; a plain ``reward_fn`` is
called on a worker thread). The group's rewards are joined right after the next group's rollout, before the
schedule's ``on_rewards`` / ``on_group_rewards`` and before any advantage, and every hook runs in the order it
runs without it, so rewards, advantages and gradients are the same bit for bit. What grows is what the
schedule holds while it waits: the next group's trajectories, and Retain's graphs or Reweight's provisional
gradients of two groups instead of one. The ``reward`` phase is then the time spent waiting for the scores.

Under context and pipeline parallelism a sample is scored once, on CP rank 0 of the last stage, and the other
ranks of the sample receive its rewards (:meth:`RewardJoin._score`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch
import torch.distributed as dist

from leangrpo_mcore.diffusion.trajectory import Conditioning, Trajectory
from leangrpo_mcore.diffusion.velocity import finish_latents
from leangrpo_mcore.engine.step.records import GroupRecord, ScoringGroup, StepInputs
from leangrpo_mcore.parallel.groups import PromptShare, gather_group_rewards
from leangrpo_mcore.schedules.base import GroupUpdate, PhaseTimer


def _check_rewards(rewards: torch.Tensor, batch: int, components: int = 0) -> torch.Tensor:
    """``rewards`` as float32 of shape (batch,), or (batch, components) for component rewards; ValueError else."""
    rewards = torch.as_tensor(rewards)
    shape = (batch, components) if components else (batch,)
    if rewards.shape != shape:
        raise ValueError(f"reward_fn must return shape {shape}, got {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"reward_fn returned {int((~torch.isfinite(rewards)).sum())} non-finite rewards")
    return rewards.detach().to(torch.float32)


class RewardJoin:
    """The scoring half of :class:`~leangrpo_mcore.engine.step.engine.StepEngine` (a mixin: it reads the engine's
    ``plan``, ``ctx``, ``split``, ``shares``, ``reward_fn``, ``gather_groups``, ``gathering`` and ``_scorer``, and
    rolls out with :meth:`~leangrpo_mcore.engine.step.rollout.GroupRollout._roll_out_group`)."""

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

    def _submit(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor, conditioning: Conditioning) -> Future:
        """A Future of ``reward_fn``'s rewards: its own ``submit`` where it has one, else a worker thread."""
        final_latents = finish_latents(self.velocity_fn, final_latents, conditioning)
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

    def _score(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B,) checked rewards of a micro-batch, scored once per sample: under CP the whole latents on CP rank 0,
        under PP on the last stage (every stage holds the same latents), under both on CP rank 0 of the last
        stage; the other ranks of the sample receive the result (or the error). What is scored are the finished
        samples (:func:`~leangrpo_mcore.diffusion.velocity.finish_latents`)."""
        batch, components = final_latents.shape[0], self.plan.components
        # the scorer's result travels along its pipeline (from the last stage), then across the CP ranks of each stage
        hops = [(self.ctx.pp_group, int(self.ctx.layout.pp) - 1)] if self.ctx.pp_group is not None else []
        hops += [(self.ctx.cp_group, 0)] if self.split is not None else []
        if not hops:
            finished = finish_latents(self.velocity_fn, final_latents, conditioning)
            return _check_rewards(self.reward_fn(finished, prompt_ids), batch, components)
        whole = self.split.gather(final_latents) if self.split is not None else final_latents
        whole = finish_latents(self.velocity_fn, whole, conditioning)
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
