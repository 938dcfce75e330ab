"""The rollout of the step engine: one prompt group's generations denoised micro-batch by micro-batch (or all
together through pipeline stages), their inputs drawn from the step's seeds."""

from __future__ import annotations

import dataclasses

import torch

from leangrpo_mcore.diffusion.draws import RolloutInputs, draw_rollout_inputs
from leangrpo_mcore.diffusion.lockstep import rollout_together
from leangrpo_mcore.diffusion.sampler import RolloutLoop
from leangrpo_mcore.engine.step.records import GroupRecord, ScoringGroup, StepInputs
from leangrpo_mcore.parallel.groups import PromptShare
from leangrpo_mcore.schedules.base import PhaseTimer


class GroupRollout:
    """The rollout half of :class:`~leangrpo_mcore.engine.step.engine.StepEngine` (a mixin: it reads the engine's
    ``plan``, ``ctx``, ``velocity_fn``, ``precision``, ``split``, ``shares`` and ``progress``, and scores with
    :class:`~leangrpo_mcore.engine.step.reward_join.RewardJoin`)."""

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
                rewards.append(self._submit(trajectories[-1].final_latents, ids, trajectories[-1].conditioning))
                continue
            with timer.phase("reward"):
                local = self._score(trajectories[-1].final_latents, ids, trajectories[-1].conditioning)
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
        if plan.experts is not None and plan.experts.train != "both":  # only the trained expert's steps train
            draws = dataclasses.replace(draws, selected=draws.selected & plan.experts.trained(sigmas))
        return sigmas, draws

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
