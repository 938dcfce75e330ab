"""The ODE steps outside the SDE window: DPM-Solver++(2M) against the multistep update written out in float64 from
its formula, and Euler bit for bit the sampler's default."""

import math

import numpy as np
import pytest
import torch

from leangrpo_mcore.diffusion.ode_solvers import make_ode_solver
from leangrpo_mcore.diffusion.draws import draw_rollout_inputs
from leangrpo_mcore.diffusion.sampler import SDEParams, rollout
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning

SHAPE = (3, 4)
WEIGHT = np.random.default_rng(0).standard_normal((4, 4)) * 0.5


def _velocity(x, sigma, _cond):
    """A smooth nonlinear velocity in float32 (the reference evaluates the same function in float64)."""
    w = torch.tensor(WEIGHT, dtype=torch.float32)
    return torch.tanh(x @ w) * (1 + sigma.view(-1, 1, 1)) - 0.3 * x


def _velocity64(x: np.ndarray, sigma: float) -> np.ndarray:
    return np.tanh(x @ WEIGHT) * (1 + sigma) - 0.3 * x


def _dpmpp_2m_reference(x: np.ndarray, sigmas: np.ndarray, ode: list[bool], sde_next: dict) -> np.ndarray:
    """DPM-Solver++(2M) (midpoint) in its textbook form, float64: α = 1 − σ, λ = log(α/σ), D = x − σ·v,
    x_t = (σ_t/σ_s)·x − α_t(e^{−h} − 1)·D0 − ½·α_t(e^{−h} − 1)·D1 with D1 = (D0 − D_prev)/r, r = h_prev/h; first
    order at the first step, into σ = 0 and out of σ = 1. ``sde_next[t]`` is x_{t+1} of an SDE step (taken from
    the rollout: its noise is the sampler's)."""
    prev = None  # (D, λ) of the step before
    for t, is_ode in enumerate(ode):
        s, n = float(sigmas[t]), float(sigmas[t + 1])
        d0 = x - s * _velocity64(x, s)
        lam_s = math.log((1 - s) / s) if s < 1 else -math.inf
        if is_ode:
            if n == 0:
                x_next = d0
            else:
                lam_t = math.log((1 - n) / n)
                h = lam_t - lam_s
                first = (n / s) * x - (1 - n) * (math.exp(-h) - 1) * d0
                if prev is None or not math.isfinite(prev[1]):
                    x_next = first
                else:
                    r = (lam_s - prev[1]) / h
                    x_next = first - 0.5 * (1 - n) * (math.exp(-h) - 1) * (d0 - prev[0]) / r
        else:
            x_next = sde_next[t]
        prev, x = (d0, lam_s), x_next
    return x


def _rollout(solver: str, sigmas: torch.Tensor, *, window: tuple[int, int] | None, batch: int = 2, **extra):
    steps = sigmas.numel() - 1
    selection = ({"method": "sde_window", "fraction": 1.0, "window_size": window[1], "window_range": (0, steps - window[1] + 1),
                  "window_start": window[0]} if window else {"method": "flow_grpo", "fraction": 1.0})
    draws = draw_rollout_inputs(base_seed=4, step=1, prompt_slots=[0] * batch, generation_ids=list(range(batch)),
                                latent_shape=SHAPE, num_steps=steps, selection=selection)
    sde_steps = draws.sde_steps if window else torch.zeros_like(draws.sde_steps)
    selected = draws.selected if window else torch.zeros_like(draws.selected)
    traj = rollout(_velocity, draws.init_latents, sigmas, Conditioning(encoder_hidden_states=torch.zeros(batch, 1, 1)),
                   sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas), selected=selected, sde_steps=sde_steps,
                   noise_seeds=draws.noise_seeds, prompt_ids=torch.zeros(batch, dtype=torch.long),
                   generation_ids=torch.arange(batch), ode_solver=solver, **extra)
    return draws, traj


@pytest.mark.parametrize("window", [None, (3, 2)], ids=["all_ode", "window_in_the_middle"])
def test_dpmpp_2m_rollout_matches_the_multistep_formula(window):
    sigmas = get_sigmas("sd3", 8, shift=3.0)
    draws, traj = _rollout("dpmpp_2m", sigmas, window=window)
    ode = [not bool(v) for v in traj.selected[0]] if window else [True] * 8
    for row in range(2):
        sde_next = {t: traj.next_latents[row, t].double().numpy() for t in range(8) if not ode[t]}
        expected = _dpmpp_2m_reference(draws.init_latents[row].double().numpy(), sigmas.double().numpy(), ode,
                                       sde_next)
        np.testing.assert_allclose(traj.final_latents[row].double().numpy(), expected, rtol=0, atol=1e-6)
    _, euler = _rollout("euler", sigmas, window=window)
    assert float((euler.final_latents - traj.final_latents).abs().max()) > 1e-3  # the correction is a real term


def test_dpmpp_2m_first_steps_are_euler_bit_for_bit():
    """No predecessor, then a predecessor at σ = 1: both first order, which is Euler's update exactly."""
    sigmas = get_sigmas("sd3", 6, shift=3.0)
    _, dpm = _rollout("dpmpp_2m", sigmas, window=None)
    _, euler = _rollout("euler", sigmas, window=None)
    assert torch.equal(dpm.next_latents[:, :2], euler.next_latents[:, :2])
    assert not torch.equal(dpm.next_latents[:, 2], euler.next_latents[:, 2])


def test_euler_rollouts_are_the_default_sampler_bit_for_bit():
    sigmas = get_sigmas("flux", 6, image_seq_len=16)
    for window in (None, (2, 2)):
        draws, default = _rollout("euler", sigmas, window=window)
        sde_steps = draws.sde_steps if window else torch.zeros_like(draws.sde_steps)
        plain = rollout(_velocity, draws.init_latents, sigmas, Conditioning(encoder_hidden_states=torch.zeros(2, 1, 1)),
                        sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas),
                        selected=draws.selected if window else torch.zeros_like(draws.selected), sde_steps=sde_steps,
                        noise_seeds=draws.noise_seeds, prompt_ids=torch.zeros(2, dtype=torch.long),
                        generation_ids=torch.arange(2))
        assert torch.equal(plain.next_latents, default.next_latents)
        # and the ODE steps are x + v·(σ' − σ) in float32, written out
        x = draws.init_latents
        for t in range(6):
            v = _velocity(x, sigmas[t].expand(2), None)
            step = x + v * (sigmas[t + 1] - sigmas[t])
            x = plain.next_latents[:, t] if bool(sde_steps[0, t]) else step
            assert torch.equal(plain.next_latents[:, t], x)


def test_per_sample_forwards_keep_each_rows_history():
    """Reweight's per-sample forwards hand the solver one row at a time: the same rollout up to float rounding."""
    sigmas = get_sigmas("sd3", 8, shift=3.0)
    _, batched = _rollout("dpmpp_2m", sigmas, window=(3, 2))
    selected = torch.zeros(2, 8, dtype=torch.bool)
    selected[:, 3:5] = True
    _, rows = _rollout("dpmpp_2m", sigmas, window=(3, 2), grad_steps=selected, per_sample_grad=True)
    torch.testing.assert_close(rows.final_latents, batched.final_latents, rtol=0, atol=1e-6)


def test_a_step_closed_with_an_unobserved_row_fails_loudly():
    solver = make_ode_solver("dpmpp_2m", 2)
    solver.observe(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1) * 0.5, [0])
    with pytest.raises(RuntimeError, match="every row"):
        solver.commit()
    with pytest.raises(ValueError, match="unknown ODE solver"):
        make_ode_solver("heun", 2)
