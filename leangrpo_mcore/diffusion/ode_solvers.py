"""The deterministic steps outside the SDE window: Euler, or second-order multistep DPM-Solver++ (docs/algorithms.md §8).

Flow matching writes x = (1 − σ)·x₀ + σ·ε, so α = 1 − σ, the half log-SNR is λ = log((1 − σ) / σ) and the data
prediction of a velocity v at (x, σ) is D = x − σ·v. DPM-Solver++'s first-order update from σ_s to σ_t,
(σ_t / σ_s)·x + α_t·(1 − e^{−h})·D with h = λ_t − λ_s, is exactly the Euler step x + (σ_t − σ_s)·v, so
``dpmpp_2m`` is the Euler step plus the second-order (midpoint) correction of the multistep method:

    x_t = x + (σ_t − σ_s)·v + ½·α_t·(1 − e^{−h})·(D − D_prev) / r,    r = (λ_s − λ_prev) / h

with D_prev the data prediction of the step before (at σ_prev), whatever kind of step that was: as in MixGRPO,
the SDE steps of the window feed the history too. A step falls back to first order (Euler, bit for bit) when it has
no predecessor, when σ_t = 0 (λ_t = ∞: the last step lands on D itself) and when σ_prev = 1 (λ_prev = −∞: the
correction's limit is 0). The coefficients are computed in float64 from the float32 sigmas, the update in float32.

A solver serves one micro-batch's rollout: every step, each row's forward passes through :meth:`RowSolver.observe`
(its data prediction), the ODE rows through :meth:`RowSolver.step`, and :meth:`OdeSolver.commit` closes the step.
Rows marked ``first_order`` take the Euler step whatever the solver (MixGRPO-Flash's Euler before the SDE window),
while their forwards still feed the history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from leangrpo_mcore.diffusion.sde import ode_step

ODE_SOLVERS = ("euler", "dpmpp_2m")

Rows = Optional[list[int]]
"""Rows of the micro-batch a forward covers (None: all of them)."""


def _take(values: torch.Tensor, rows: Rows) -> torch.Tensor:
    return values if rows is None else values[rows]


def _per_sample(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.view(-1, *([1] * (ndim - 1)))


class OdeSolver:
    """Euler (``euler``): stateless, today's ODE step."""

    name = "euler"

    def on(self, rows: Rows = None, first_order: Optional[torch.Tensor] = None) -> RowSolver:
        """The solver for the forward of ``rows`` (``first_order``: a host bool per row of ``rows`` taking Euler)."""
        return RowSolver(self, rows, first_order)

    def step(self, velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             rows: Rows, first_order: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(n, *shape) float32 x_{t+1} of ``rows`` (x, velocity, sigmas: those rows')."""
        return ode_step(velocity, x, sigma, sigma_next)

    def observe(self, velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, rows: Rows) -> None:
        """Note the forward of ``rows`` at this step (any kind of step)."""

    def commit(self) -> None:
        """Close the step: what was observed becomes the previous step's."""


@dataclass(frozen=True)
class RowSolver:
    """An :class:`OdeSolver` bound to the rows of one forward."""

    solver: OdeSolver
    rows: Rows = None
    first_order: Optional[torch.Tensor] = None
    """(n,) host bool: the rows that take the Euler step whatever the solver (None: none)."""

    def step(self, velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor,
             sigma_next: torch.Tensor) -> torch.Tensor:
        """The ODE step of the rows (detached velocity)."""
        return self.solver.step(velocity, x, sigma, sigma_next, self.rows, self.first_order)

    def observe(self, velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> None:
        """Note the rows' forward."""
        self.solver.observe(velocity, x, sigma, self.rows)


def _half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """λ = log((1 − σ) / σ) (float64 in, float64 out)."""
    return torch.log1p(-sigma) - torch.log(sigma)


def second_order_coefficient(sigma_prev: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
                             ) -> torch.Tensor:
    """(n,) float32 ½·α_t·(1 − e^{−h}) / r of the 2M correction (module docstring), 0 where it is first order."""
    prev, s, t = (v.to(torch.float64) for v in (sigma_prev, sigma, sigma_next))
    second = (t > 0) & (prev < 1)
    # α_t·(1 − e^{−h}) = 1 − σ_t/σ_s for flow matching; the logs only enter through r
    safe_t, safe_prev = torch.where(second, t, s), torch.where(second, prev, s)
    h, h_prev = _half_log_snr(safe_t) - _half_log_snr(s), _half_log_snr(s) - _half_log_snr(safe_prev)
    coeff = 0.5 * (1 - t / s) * h / torch.where(second, h_prev, torch.ones_like(h_prev))
    return torch.where(second, coeff, torch.zeros_like(coeff)).to(torch.float32)


class DPMSolverPP2M(OdeSolver):
    """``dpmpp_2m``: Euler plus the multistep second-order correction; keeps each row's previous data prediction."""

    name = "dpmpp_2m"

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self._x0: Optional[torch.Tensor] = None
        """(B, *shape) float32 data prediction of the previous step."""
        self._sigma: Optional[torch.Tensor] = None
        """(B,) float32 σ of the previous step."""
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        """This step's (data predictions, sigmas, rows seen) while it is being taken."""

    def step(self, velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             rows: Rows, first_order: Optional[torch.Tensor] = None) -> torch.Tensor:
        euler = ode_step(velocity, x, sigma, sigma_next)
        if self._x0 is None or (first_order is not None and bool(first_order.all())):
            return euler
        coeff = second_order_coefficient(_take(self._sigma, rows), sigma.to(torch.float32),
                                         sigma_next.to(torch.float32))
        if first_order is not None:  # a zero coefficient leaves Euler's update bit for bit
            coeff = torch.where(first_order.to(coeff.device), torch.zeros_like(coeff), coeff)
        x0 = x.to(torch.float32) - _per_sample(sigma.to(torch.float32), x.ndim) * velocity.to(torch.float32)
        return euler + _per_sample(coeff, x.ndim) * (x0 - _take(self._x0, rows))

    def observe(self, velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, rows: Rows) -> None:
        if self._pending is None:
            self._pending = (torch.zeros(self.batch, *x.shape[1:], device=x.device, dtype=torch.float32),
                             torch.zeros(self.batch, device=x.device, dtype=torch.float32),
                             torch.zeros(self.batch, dtype=torch.bool))
        x0, sigmas, seen = self._pending
        sigma = sigma.detach().to(torch.float32)
        index = slice(None) if rows is None else rows
        x0[index] = x.detach().to(torch.float32) - _per_sample(sigma, x.ndim) * velocity.detach().to(torch.float32)
        sigmas[index] = sigma
        seen[index] = True

    def commit(self) -> None:
        if self._pending is None or not bool(self._pending[2].all()):
            raise RuntimeError("dpmpp_2m: a step closed before every row's forward was observed")
        self._x0, self._sigma, _ = self._pending
        self._pending = None


def make_ode_solver(name: str, batch: int) -> OdeSolver:
    """The solver ``name`` (one of ``ODE_SOLVERS``) for a micro-batch of ``batch`` rows."""
    if name == "euler":
        return OdeSolver()
    if name == "dpmpp_2m":
        return DPMSolverPP2M(batch)
    raise ValueError(f"unknown ODE solver {name!r}; valid: {', '.join(ODE_SOLVERS)}")
