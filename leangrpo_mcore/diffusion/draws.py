"""The seeded inputs of a rollout, drawn before its first forward from (seed, step, prompt slot, generation) alone:
the initial noise, the trained and SDE steps, the SDE noise seeds (docs/algorithms.md §7)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class RolloutInputs:
    """The seeded inputs of a micro-batch's rollout (everything random, drawn before the first forward)."""

    init_latents: torch.Tensor
    """(B, *shape) float32 initial noise."""
    selected: torch.Tensor
    """(B, T) bool trained steps."""
    sde_steps: torch.Tensor
    """(B, T) bool SDE steps."""
    noise_seeds: torch.Tensor
    """(B, T) int64 SDE-noise seeds."""


def draw_rollout_inputs(*, base_seed: int, step: int, prompt_slots: list[int], generation_ids: list[int],
                        latent_shape: tuple[int, ...], num_steps: int, selection: dict,
                        same_latent: bool = False, device: torch.device | str = "cpu") -> RolloutInputs:
    """Seed everything of B samples named by (prompt slot, generation) — independent of rank and schedule.

    ``selection`` holds the keyword arguments of :func:`leangrpo_mcore.diffusion.selection.select_steps`
    besides the sample names (method, fraction, window_size, window_range, window_start).
    """
    from leangrpo_mcore.diffusion.seeding import initial_noise, sde_noise_seeds
    from leangrpo_mcore.diffusion.selection import select_steps

    init = initial_noise(base_seed, step, prompt_slots, generation_ids, latent_shape, same_latent=same_latent,
                         device=device)
    picked = select_steps(selection["method"], num_steps=num_steps, fraction=selection["fraction"],
                          base_seed=base_seed, step=step, prompt_slots=prompt_slots, generation_ids=generation_ids,
                          window_size=selection.get("window_size", 0),
                          window_range=selection.get("window_range", (0, 1)),
                          window_start=selection.get("window_start"))
    seeds = sde_noise_seeds(base_seed, step, prompt_slots, generation_ids, num_steps)
    return RolloutInputs(init_latents=init, selected=picked.selected, sde_steps=picked.sde, noise_seeds=seeds)
