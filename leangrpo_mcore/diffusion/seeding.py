"""Seeds of every random draw of a training step, from ``train.seed`` alone (docs/algorithms.md §7).

A draw is named by a *purpose* and integer coordinates: the training step, the prompt slot within the step
(0 .. prompts_per_step − 1), the generation within the prompt's group and, for SDE noise, the denoising
step. The seed is a fixed mixing function of those numbers and nothing else: not of the rank, the world
size, the data-parallel layout, tensor parallelism or the update schedule. The same config therefore draws
the same initial noise, SDE noise and selected steps whichever rank makes a sample, which is what lets
Native, Retain and Reweight (and world sizes 1, 2, 4) produce identical trajectories.

All draws happen on CPU generators in float32 and are moved to the target device afterwards, so GPU and
CPU runs of the same config agree as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PURPOSES = ("init_noise", "sde_noise", "selection", "window", "eval_noise")
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """One round of SplitMix64: a bijective 64-bit mix with good avalanche."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def derive_seed(base_seed: int, purpose: str, *coords: int) -> int:
    """A 63-bit seed determined by ``base_seed``, ``purpose`` and the integer coordinates only."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r}; valid: {', '.join(PURPOSES)}")
    state = _splitmix64(int(base_seed) & _MASK64)
    for value in (PURPOSES.index(purpose) + 1, len(coords), *coords):
        if int(value) < 0:
            raise ValueError(f"seed coordinates must be non-negative, got {coords}")
        state = _splitmix64(state ^ (int(value) & _MASK64))
    # torch.Generator.manual_seed takes any 64-bit value; staying below 2**63 keeps it portable.
    return state >> 1


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    return gen


def initial_noise(
    base_seed: int,
    step: int,
    prompt_slots: Sequence[int],
    generation_ids: Sequence[int],
    shape: Sequence[int],
    *,
    same_latent: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(B, *shape) float32 standard normal noise, one draw per (step, prompt slot, generation).

    With ``same_latent`` every generation of a prompt starts from the noise of generation 0.
    """
    if len(prompt_slots) != len(generation_ids):
        raise ValueError(f"{len(prompt_slots)} prompt slots for {len(generation_ids)} generation ids")
    draws = []
    for slot, gen_id in zip(prompt_slots, generation_ids):
        seed = derive_seed(base_seed, "init_noise", step, slot, 0 if same_latent else gen_id)
        draws.append(torch.randn(tuple(shape), generator=generator(seed), dtype=torch.float32))
    return torch.stack(draws).to(device)


def sde_noise_seeds(
    base_seed: int, step: int, prompt_slots: Sequence[int], generation_ids: Sequence[int], num_steps: int
) -> torch.Tensor:
    """(B, T) int64 seeds of the SDE noise of denoising step t of each sample (always per generation)."""
    if len(prompt_slots) != len(generation_ids):
        raise ValueError(f"{len(prompt_slots)} prompt slots for {len(generation_ids)} generation ids")
    rows = [
        [derive_seed(base_seed, "sde_noise", step, slot, gen_id, t) for t in range(num_steps)]
        for slot, gen_id in zip(prompt_slots, generation_ids)
    ]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), num_steps)


def step_generators(noise_seeds: torch.Tensor, t: int) -> list[torch.Generator]:
    """One CPU generator per sample for denoising step ``t`` from the (B, T) seeds of :func:`sde_noise_seeds`."""
    return [generator(int(seed)) for seed in noise_seeds[:, t].tolist()]


def step_noise(noise_seeds: torch.Tensor, t: int, rows: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """(len(rows), *shape) float32 standard normal SDE noise of denoising step ``t`` of the samples ``rows``, drawn on
    the CPU, each from its own generator seeded by the (B, T) ``noise_seeds`` (:func:`sde_noise_seeds`): the same
    numbers as :func:`step_generators`' generators draw, made only for the rows asked for."""
    seeds = noise_seeds[list(rows), t].tolist()
    return torch.stack([torch.randn(tuple(shape), generator=generator(int(seed)), dtype=torch.float32)
                        for seed in seeds])


def eval_inputs(seed: int, prompt_indices: Sequence[int], sample_indices: Sequence[int], shape: Sequence[int],
                num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluation noise of B samples named by (eval prompt index, sample index): (B, *shape) float32 initial
    noise and (B, T) int64 SDE-noise seeds, from ``(seed, i, j)`` alone (never the step, rank or layout), so that
    every evaluation of a run starts from the same noise."""
    if len(prompt_indices) != len(sample_indices):
        raise ValueError(f"{len(prompt_indices)} prompt indices for {len(sample_indices)} sample indices")
    pairs = list(zip(prompt_indices, sample_indices))
    init = torch.stack([torch.randn(tuple(shape), generator=generator(derive_seed(seed, "eval_noise", 0, i, j)),
                                    dtype=torch.float32) for i, j in pairs])
    seeds = [[derive_seed(seed, "eval_noise", 1, i, j, t) for t in range(num_steps)] for i, j in pairs]
    return init, torch.tensor(seeds, dtype=torch.long).reshape(len(pairs), num_steps)
