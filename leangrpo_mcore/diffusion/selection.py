"""The selected (trained) steps S of every sample, drawn before the rollout (docs/algorithms.md §4, §7).

Three methods, matching the baselines:

- ``flow_grpo``: the first ``int(T · fraction)`` steps of every sample, SDE on every step (FLUX T=6 → 5).
- ``sde_window`` (FlowGRPO-Fast): a window of ``window_size`` consecutive steps whose start is drawn
  uniformly from ``[window_range[0], window_range[1])`` once per prompt group (the whole group shares it);
  the SDE runs only inside the window, the ODE elsewhere, and exactly the window is trained. A given
  ``window_start`` (a fixed or progressive window, :mod:`leangrpo_mcore.diffusion.window`) replaces the draw.
- ``dance_grpo``: per sample, a random permutation of the T − 1 candidate steps (the last step, σ' = 0,
  is never trained) of which the first ``int((T − 1) · fraction)`` are kept; SDE on every step.

Draws come from :mod:`leangrpo_mcore.diffusion.seeding` (per prompt slot or per generation), so the
selection is the same on every rank, layout and schedule. Picking S before the rollout is what lets
Retain and Reweight know which forwards need gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leangrpo_mcore.diffusion.seeding import derive_seed, generator
from leangrpo_mcore.diffusion.sigmas import timesteps_from_sigmas

SELECTION_METHODS = ("flow_grpo", "sde_window", "dance_grpo")
EXPERT_CHOICES = ("both", "high", "low")


@dataclass(frozen=True)
class Selection:
    """Which steps of each sample are trained and which use the SDE (the others take the ODE step)."""

    selected: torch.Tensor
    """(B, T) bool: the trained steps S."""
    sde: torch.Tensor
    """(B, T) bool: steps sampled with the SDE (and scored with a log-density); S ⊆ sde."""


@dataclass(frozen=True)
class ExpertSteps:
    """A two-expert policy's split of the denoising steps (Wan2.2-A14B): a step whose scheduler timestep is at
    least ``boundary`` runs the high-noise expert, the others the low-noise one, as the policy routes them
    (``models/wan/experts.py``). With one expert trained, only the selected steps it runs are trained: the others
    would give its parameters no gradient, so leaving them out changes nothing but the work."""

    boundary: float
    """The scheduler timestep at which the low-noise expert takes over (boundary_ratio x 1000)."""
    sigma_kind: str
    """The sigma schedule, whose timestep convention the policy receives."""
    train: str = "both"
    """Which experts train: both, high or low."""

    def high(self, sigmas: torch.Tensor) -> torch.Tensor:
        """(T,) bool of a (T+1,) schedule: the steps the high-noise expert runs."""
        return timesteps_from_sigmas(sigmas[:-1], self.sigma_kind) >= self.boundary

    def trained(self, sigmas: torch.Tensor) -> torch.Tensor:
        """(T,) bool: the steps whose expert trains."""
        high = self.high(sigmas)
        return {"both": torch.ones_like(high), "high": high, "low": ~high}[self.train]


def num_selected(method: str, num_steps: int, fraction: float, window_size: int = 0) -> int:
    """|S| per sample for ``method`` (the same for every sample); ValueError when it would be 0."""
    check_selection(method, num_steps, fraction, window_size, (0, 1))
    if method == "flow_grpo":
        return int(num_steps * fraction)
    if method == "dance_grpo":
        return int((num_steps - 1) * fraction)
    return window_size


def check_selection(
    method: str, num_steps: int, fraction: float, window_size: int, window_range: Sequence[int]
) -> None:
    """Raise ValueError (one line) unless the selection settings give at least one trained step."""
    if method not in SELECTION_METHODS:
        raise ValueError(f"unknown timestep selection {method!r}; valid: {', '.join(SELECTION_METHODS)}")
    if num_steps < 1 or not 0.0 < fraction <= 1.0:
        raise ValueError(f"need num_steps >= 1 and 0 < fraction <= 1, got {num_steps} and {fraction}")
    if method == "flow_grpo" and int(num_steps * fraction) < 1:
        raise ValueError(f"timestep_fraction {fraction} of {num_steps} steps selects no step")
    if method == "dance_grpo" and (num_steps < 2 or int((num_steps - 1) * fraction) < 1):
        raise ValueError(f"dance_grpo selection keeps int((T-1)*f) steps: T={num_steps}, f={fraction} keeps none")
    if method == "sde_window":
        if len(window_range) != 2 or not 0 <= window_range[0] < window_range[1]:
            raise ValueError(f"sde_window_range must be [low, high) with 0 <= low < high, got {list(window_range)}")
        if window_size < 1:
            raise ValueError("sde_window selection needs sampler.sde_window_size >= 1")
        if window_range[1] - 1 + window_size > num_steps:
            raise ValueError(
                f"an SDE window of {window_size} steps starting as late as {window_range[1] - 1} "
                f"overruns the {num_steps} steps"
            )


def select_steps(
    method: str,
    *,
    num_steps: int,
    fraction: float,
    base_seed: int,
    step: int,
    prompt_slots: Sequence[int],
    generation_ids: Sequence[int],
    window_size: int = 0,
    window_range: Sequence[int] = (0, 1),
    window_start: int | None = None,
) -> Selection:
    """Draw the :class:`Selection` of B samples named by (``prompt_slots``, ``generation_ids``); ``window_start``
    (``sde_window`` only) puts every sample's window there instead of drawing it per prompt group."""
    check_selection(method, num_steps, fraction, window_size, window_range)
    if window_start is not None and (method != "sde_window" or not 0 <= window_start <= num_steps - window_size):
        raise ValueError(f"a window start of {window_start} needs sde_window selection and a window inside the "
                         f"{num_steps} steps")
    if len(prompt_slots) != len(generation_ids):
        raise ValueError(f"{len(prompt_slots)} prompt slots for {len(generation_ids)} generation ids")
    batch = len(prompt_slots)
    selected = torch.zeros(batch, num_steps, dtype=torch.bool)
    sde = torch.ones(batch, num_steps, dtype=torch.bool)
    if method == "flow_grpo":
        selected[:, : int(num_steps * fraction)] = True
    elif method == "dance_grpo":
        keep = int((num_steps - 1) * fraction)
        for i, (slot, gen_id) in enumerate(zip(prompt_slots, generation_ids)):
            gen = generator(derive_seed(base_seed, "selection", step, slot, gen_id))
            selected[i, torch.randperm(num_steps - 1, generator=gen)[:keep]] = True
    else:
        sde.zero_()
        low, high = int(window_range[0]), int(window_range[1])
        for i, slot in enumerate(prompt_slots):
            if window_start is None:
                gen = generator(derive_seed(base_seed, "window", step, slot))
                start = low + int(torch.randint(high - low, (1,), generator=gen))
            else:
                start = window_start
            selected[i, start : start + window_size] = True
            sde[i, start : start + window_size] = True
    return Selection(selected=selected, sde=sde)
