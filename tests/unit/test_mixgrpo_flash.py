"""MixGRPO-Flash's rollout as published: Euler before the SDE window, the window's SDE steps, DPM-Solver++(2M) after
it over a tail whose size is a ratio of the remaining steps, re-spaced on the schedule's time grid.

The reference is written here from MixGRPO-Flash's sampling rule (its ``dpm_apply_strategy="post"``): the schedule
``cat(σ[:last + 1], shift(linspace(t[last + 1], 0, P)))`` with P = int(max((T − last)·r, 1)) points and ``last`` the
window's last step, Euler steps x + (σ' − σ)·v before the window, and diffusers' ``DPMSolverMultistepScheduler``
(flow sigmas, dpmsolver++, order 2, midpoint) stepping the tail, its history primed with the data prediction of the
window's last step. The window's own SDE steps are taken from the rollout (their noise is the sampler's; the SDE step
is pinned elsewhere).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from leangrpo_mcore.diffusion.draws import draw_rollout_inputs
from leangrpo_mcore.diffusion.sampler import SDEParams, rollout
from leangrpo_mcore.diffusion.sigmas import SigmaSpec
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.window import SDEWindow
from leangrpo_mcore.engine.step import StepPlan

STEPS, WINDOW, RATIO, SHIFT = 12, 2, 0.4, 3.0
SHAPE = (3, 4)
WEIGHT = torch.tensor(np.random.default_rng(0).standard_normal((4, 4)) * 0.5, dtype=torch.float32)


def _velocity(x: torch.Tensor, sigma: torch.Tensor, _cond=None) -> torch.Tensor:
    """A smooth nonlinear velocity, float32."""
    return torch.tanh(x @ WEIGHT) * (1 + sigma.view(-1, 1, 1)) - 0.3 * x


def _published_sigmas(start: int) -> torch.Tensor:
    """MixGRPO-Flash's schedule for a window of WINDOW steps at ``start`` on its schedule (linspace + time shift)."""
    t = torch.linspace(1, 0, STEPS + 1)
    sigmas = (SHIFT * t) / (1 + (SHIFT - 1) * t)
    last = start + WINDOW - 1
    points = int(max((STEPS - last) * RATIO, 1))
    post = torch.linspace(t[last + 1].item(), 0, points)
    return torch.cat([sigmas[: last + 1], (SHIFT * post) / (1 + (SHIFT - 1) * post)])


def _plan() -> StepPlan:
    spec = SigmaSpec("dance", shift=SHIFT)
    sigmas = spec.sigmas(STEPS)
    return StepPlan(schedule="native", group_size=2, prompts_per_step=1, latent_shape=SHAPE, sigmas=sigmas,
                    sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas), objective=None,
                    selection={"method": "sde_window", "fraction": 1.0, "window_size": WINDOW,
                               "window_range": (0, STEPS - WINDOW + 1)},
                    window=SDEWindow(size=WINDOW, low=0, high=STEPS - WINDOW + 1, schedule="fixed",
                                     ode_steps_after=RATIO),
                    ode_solver="dpmpp_2m", ode_before_window="euler", sigma_spec=spec)


def _rollout(sigmas: torch.Tensor, start: int, before: str):
    steps = sigmas.numel() - 1
    draws = draw_rollout_inputs(base_seed=4, step=1, prompt_slots=[0, 0], generation_ids=[0, 1], latent_shape=SHAPE,
                                num_steps=STEPS, selection={"method": "sde_window", "fraction": 1.0,
                                                            "window_size": WINDOW, "window_range": (0, STEPS - 1),
                                                            "window_start": start})
    traj = rollout(_velocity, draws.init_latents, sigmas, Conditioning(encoder_hidden_states=torch.zeros(2, 1, 1)),
                   sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas), selected=draws.selected[:, :steps],
                   sde_steps=draws.sde_steps[:, :steps], noise_seeds=draws.noise_seeds[:, :steps],
                   prompt_ids=torch.zeros(2, dtype=torch.long), generation_ids=torch.arange(2), ode_solver="dpmpp_2m",
                   ode_before_window=before)
    return draws, traj


def _diffusers_tail(x_end: torch.Tensor, x_last: torch.Tensor, sigmas: torch.Tensor, last: int) -> torch.Tensor:
    """diffusers' DPM-Solver++(2M) over sigmas[last:], primed with the window's last step (x_last at σ_last), from
    x_end (the window's output at σ_{last + 1})."""
    tail = sigmas[last:].to(torch.float32)
    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                            algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                            final_sigmas_type="zero")
    scheduler.set_timesteps(tail.numel() - 1)
    scheduler.sigmas, scheduler.timesteps = tail.clone(), tail[:-1] * 1000
    scheduler.num_inference_steps = tail.numel() - 1
    # the window's last step feeds the history (its output is the SDE's, replaced by x_end)
    scheduler.step(_velocity(x_last, tail[:1].expand(x_last.shape[0])), scheduler.timesteps[0], x_last)
    x = x_end
    for i in range(1, tail.numel() - 1):
        x = scheduler.step(_velocity(x, tail[i].expand(x.shape[0])), scheduler.timesteps[i], x).prev_sample
    return x


@pytest.mark.parametrize("start", [0, 3, 5])
def test_mixgrpo_flash_rollout_is_the_published_rule(start):
    plan = _plan()
    sigmas = plan.rollout_sigmas(start)
    published = _published_sigmas(start)
    assert torch.equal(sigmas, published)  # the count, the placement and the float32 rounding of MixGRPO-Flash's
    last, end = start + WINDOW - 1, start + WINDOW
    assert sigmas.numel() - 1 == end + max(int((STEPS - last) * RATIO) - 1, 1) < STEPS
    draws, traj = _rollout(sigmas, start, "euler")
    x = draws.init_latents
    for t in range(start):  # Euler before the window
        x = x + _velocity(x, sigmas[t].expand(2)) * (sigmas[t + 1] - sigmas[t])
        torch.testing.assert_close(traj.next_latents[:, t], x, rtol=0, atol=1e-6)
    x_last = traj.latents[:, last]
    expected = _diffusers_tail(traj.next_latents[:, last], x_last, sigmas, last)
    torch.testing.assert_close(traj.final_latents, expected, rtol=0, atol=2e-6)
    # the Euler start and the tail's second-order correction are real terms: 2M before the window (from the third
    # step on, the first with a predecessor below σ = 1), or Euler after it, give other images
    _, same = _rollout(sigmas, start, "same")
    if start >= 3:
        assert float((same.final_latents - traj.final_latents).abs().max()) > 1e-4
    else:
        assert torch.equal(same.final_latents, traj.final_latents)
    x = traj.next_latents[:, last]
    for t in range(end, sigmas.numel() - 1):
        x = x + _velocity(x, sigmas[t].expand(2)) * (sigmas[t + 1] - sigmas[t])
    if sigmas.numel() - 1 - end >= 2:
        assert float((x - traj.final_latents).abs().max()) > 1e-4
    else:  # one step into σ = 0 lands on the data prediction: first order, Euler's update
        assert torch.equal(x, traj.final_latents)


def test_the_ratio_tail_shrinks_as_the_window_moves():
    plan = _plan()
    lengths = [plan.rollout_sigmas(k).numel() - 1 for k in range(STEPS - WINDOW + 1)]
    after = [n - (k + WINDOW) for k, n in enumerate(lengths)]
    # MixGRPO-Flash's P = int((T − last)·0.4) points: 4, 4, 3, 3, 2, 2, 2, ... then the whole remainder
    assert after[:6] == [3, 3, 2, 2, 1, 1]
    assert after[-1] == 0 and lengths[-1] == STEPS
    assert all(torch.equal(plan.rollout_sigmas(k)[: k + WINDOW + 1], plan.sigmas[: k + WINDOW + 1])
               for k in range(STEPS - WINDOW + 1))


def test_first_order_rows_take_eulers_update_bit_for_bit():
    """A forward whose rows sit on both sides of their windows: the marked rows take Euler, the others 2M."""
    from leangrpo_mcore.diffusion.ode_solvers import make_ode_solver
    from leangrpo_mcore.diffusion.sde import ode_step

    gen = torch.Generator().manual_seed(2)
    x, v0, v1 = (torch.randn(2, *SHAPE, generator=gen) for _ in range(3))
    solver = make_ode_solver("dpmpp_2m", 2)
    sigma0, sigma1, sigma2 = (torch.full((2,), s) for s in (0.9, 0.7, 0.4))
    solver.observe(v0, x, sigma0, None)
    solver.commit()
    solver.observe(v1, x, sigma1, None)
    mixed = solver.on(None, torch.tensor([True, False])).step(v1, x, sigma1, sigma2)
    second = solver.on(None).step(v1, x, sigma1, sigma2)
    euler = ode_step(v1, x, sigma1, sigma2)
    assert torch.equal(mixed[0], euler[0]) and torch.equal(mixed[1], second[1])
    assert float((second[0] - euler[0]).abs().max()) > 1e-3
