"""Where the SDE window sits, and MixGRPO-Flash's compression of the ODE steps after it (docs/algorithms.md §8).

Three window schedules (``sampler.sde_window_schedule``), all of ``size`` consecutive SDE steps whose start lies
in ``[low, high)`` (``sampler.sde_window_range``):

- ``random`` (FlowGRPO-Fast): a start drawn per prompt group by :func:`leangrpo_mcore.diffusion.selection.select_steps`.
- ``fixed``: every rollout starts at ``low``.
- ``progressive`` (MixGRPO): the start sweeps ``low, low + stride, …`` (the last one below ``high``), moving one
  position every ``shift_every`` optimizer steps, and wraps back to ``low`` after the last one, as MixGRPO's
  progressive strategy rolls back to its first step.

A shared window (fixed, progressive) is a pure function of the optimizer steps taken before the rollout, which
the step number of the checkpointed trainer state gives: a resumed run continues at the same position.

Compression (``sampler.ode_steps_after_window``): the steps after the window, from σ_e (e = the window's end) to
σ_T = 0, are replaced by fewer ODE steps, as a count or as MixGRPO-Flash's ratio:

- a count K (a whole number): K steps over grid points of the schedule itself, σ at indices
  ``e + round(j·(T − e)/K)`` for j = 0 … K (a subset of the full rollout's sigmas);
- a ratio r in (0, 1) (MixGRPO-Flash's ``dpm_post_compress_ratio``): ``P = int(max((T − e + 1)·r, 1))`` points
  from σ_e to 0, the count MixGRPO-Flash's sampling code computes from its last SDE step e − 1, so K = P − 1 steps
  (at least one, so that the rollout still ends at σ = 0), placed as it places them: equal steps of the schedule's
  unshifted time from t_e to 0, then shifted (:meth:`~leangrpo_mcore.diffusion.sigmas.SigmaSpec.respaced_tail`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from leangrpo_mcore.config.window_rules import WINDOW_SCHEDULES, is_ratio, ratio_tail_steps, rollout_steps, window_error
from leangrpo_mcore.diffusion.sigmas import SigmaSpec
from leangrpo_mcore.errors import UserError

__all__ = ["SDEWindow", "WINDOW_SCHEDULES", "window_error", "optimizer_steps_before", "compressed_indices",
           "compress_after_window", "ratio_tail_steps", "rollout_schedule", "rollout_steps"]


@dataclass(frozen=True)
class SDEWindow:
    """The SDE window settings of a run (``sampler.sde_window_*``, ``sampler.window_*``)."""

    size: int
    """Consecutive SDE steps (0: no window, SDE on every step)."""
    low: int = 0
    """Lowest start step."""
    high: int = 1
    """One past the highest start step."""
    schedule: str = "random"
    """One of ``WINDOW_SCHEDULES``."""
    stride: int = 1
    """Progressive: steps the start moves at each shift."""
    shift_every: int = 1
    """Progressive: optimizer steps between two shifts."""
    ode_steps_after: Union[int, float] = 0
    """MixGRPO-Flash: ODE steps for the remainder after the window, a count or a ratio in (0, 1) (0: no
    compression)."""

    @property
    def shared(self) -> bool:
        """Whether every rollout of an optimizer step has the same window (fixed, progressive)."""
        return self.size > 0 and self.schedule != "random"

    def positions(self) -> list[int]:
        """The starts a progressive window visits in order: ``low, low + stride, …`` below ``high``."""
        return list(range(self.low, self.high, self.stride))

    def start(self, optimizer_steps: int) -> Optional[int]:
        """The window's start for a rollout after ``optimizer_steps`` optimizer steps; None for a random one
        (drawn per prompt group) or no window."""
        if not self.shared:
            return None
        if self.schedule == "fixed":
            return self.low
        positions = self.positions()
        return positions[(max(optimizer_steps, 0) // self.shift_every) % len(positions)]

    def check(self, num_steps: int, ode_solver: str = "euler", ode_before: str = "same") -> None:
        """One-line UserError naming the key of any setting that cannot work with ``num_steps`` steps."""
        error = window_error(size=self.size, low=self.low, high=self.high, schedule=self.schedule,
                             stride=self.stride, shift_every=self.shift_every, ode_steps_after=self.ode_steps_after,
                             ode_solver=ode_solver, num_steps=num_steps, ode_solver_before=ode_before)
        if error is not None:
            raise UserError(error)


def optimizer_steps_before(step: int, updates_per_rollout: int) -> int:
    """Optimizer steps taken before the rollout of training step ``step`` (steps count from 1; 0 for step 0)."""
    return max(step - 1, 0) * updates_per_rollout


def compressed_indices(num_steps: int, window_end: int, ode_steps: int) -> list[int]:
    """Indices into the (T+1,) sigmas of the compressed schedule: 0 … e, then K steps to T (module docstring);
    the whole schedule when there is nothing to compress."""
    remaining = num_steps - window_end
    if not ode_steps or ode_steps >= remaining:
        return list(range(num_steps + 1))
    # round(j·R/K) with halves rounded up, in integers; K < R makes the indices strictly increasing
    tail = [window_end + (2 * j * remaining + ode_steps) // (2 * ode_steps) for j in range(1, ode_steps + 1)]
    return list(range(window_end + 1)) + tail


def compress_after_window(sigmas: torch.Tensor, window_end: int, ode_steps: int) -> torch.Tensor:
    """The (T'+1,) float32 sigmas with the steps after ``window_end`` compressed to ``ode_steps`` ODE steps."""
    return sigmas[compressed_indices(sigmas.numel() - 1, window_end, ode_steps)]


def rollout_schedule(sigmas: torch.Tensor, window_end: int, after: Union[int, float],
                     spec: Optional[SigmaSpec] = None) -> torch.Tensor:
    """The (T'+1,) float32 sigmas of a rollout whose window ends at ``window_end``: ``sigmas`` up to σ_e, then the
    compressed remainder for ``after`` (a count, or a ratio, which needs the schedule's ``spec``)."""
    num_steps = sigmas.numel() - 1
    if not is_ratio(after):
        return compress_after_window(sigmas, window_end, int(after))
    steps = ratio_tail_steps(num_steps, window_end, float(after))
    if steps is None:
        return sigmas
    if spec is None:
        raise ValueError("a ratio of steps after the window re-spaces the schedule: the plan needs its SigmaSpec")
    return torch.cat([sigmas[: window_end + 1], spec.respaced_tail(num_steps, window_end, steps)])
