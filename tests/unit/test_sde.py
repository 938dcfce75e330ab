"""SDE steps against closed forms written here in numpy float64 (docs/algorithms.md §2)."""

import math

import numpy as np
import pytest
import torch

from leangrpo_mcore.diffusion import SDE_KINDS, ode_step, sde_step, transition_std

SHAPES = [(3, 16, 8), (3, 4, 2, 4, 4)]  # FLUX packed tokens (B, tokens, C); video (B, C, F, H, W)
SIGMA = np.array([1.0, 0.7, 0.3])  # sample 0 is the first step (sigma = 1)
SIGMA_NEXT = np.array([0.93, 0.55, 0.0])  # sample 2 is the last step (sigma' = 0)
SIGMA_MAX, SIGMA_MIN = 0.93, 0.01
NOISE = {"flow_grpo": 0.7, "flow_grpo_cps": 0.7, "wan": 1.0, "dance_grpo": 0.3}
GAUSSIAN_KINDS = ("flow_grpo", "wan", "dance_grpo")
RTOL, ATOL = 2e-6, 2e-6


def _bcast(values, ndim):
    return values.reshape(-1, *([1] * (ndim - 1)))


def reference_step(kind, v, x, sigma, sigma_next, a):
    """(mean, transition std s, std_t) in float64, written from the formulas, per-sample sigmas."""
    s, sn = _bcast(sigma, x.ndim), _bcast(sigma_next, x.ndim)
    dt = sn - s
    if kind == "flow_grpo_cps":
        std = sn * math.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return (1 - sn) * x0 + np.sqrt(sn**2 - std**2) * x1, std, std
    if kind == "dance_grpo":
        score = -(x - (1 - s) * (x - s * v)) / s**2
        mean = x + dt * v - 0.5 * a**2 * score * dt
        return mean, a * np.sqrt(s - sn), np.full_like(s, a)
    if kind == "flow_grpo":
        std_t = a * np.sqrt(s / (1 - np.where(s == 1, SIGMA_MAX, s)))
    else:
        std_t = SIGMA_MIN + (SIGMA_MAX - SIGMA_MIN) * s
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_t * np.sqrt(-dt), std_t


def gaussian_log_prob(xp, mean, std):
    dens = -((xp - mean) ** 2) / (2 * std**2) - np.log(std) - np.log(np.sqrt(2 * np.pi))
    return dens.reshape(dens.shape[0], -1).mean(axis=1)


def _inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v, x, xp = (torch.randn(shape, generator=gen) for _ in range(3))
    return v, x, xp


def _step(kind, v, x, **kwargs):
    return sde_step(
        kind,
        v,
        x,
        torch.tensor(SIGMA, dtype=torch.float32),
        torch.tensor(SIGMA_NEXT, dtype=torch.float32),
        noise_level=NOISE[kind],
        sigma_max=SIGMA_MAX,
        sigma_min=SIGMA_MIN,
        **kwargs,
    )


def _close(actual, expected, rtol=RTOL, atol=ATOL):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", SDE_KINDS)
def test_given_prev_sample_matches_closed_form(kind, shape):
    v, x, xp = _inputs(shape)
    out = _step(kind, v, x, prev_sample=xp)
    mean, std, _ = reference_step(kind, v.double().numpy(), x.double().numpy(), SIGMA, SIGMA_NEXT, NOISE[kind])
    _close(out.mean, mean)
    assert out.std.shape == (shape[0],) + (1,) * (len(shape) - 1)
    _close(out.std, std)
    assert torch.equal(out.prev_sample, xp)
    assert out.log_prob.shape == (shape[0],)
    xp64 = xp.double().numpy()
    if kind == "flow_grpo_cps":
        expected = -((xp64 - mean) ** 2).reshape(shape[0], -1).mean(axis=1)
        _close(out.log_prob, expected)
    else:
        _close(out.log_prob, gaussian_log_prob(xp64, mean, std), rtol=1e-6)
        normal = torch.distributions.Normal(torch.from_numpy(mean), torch.from_numpy(std).expand(shape))
        by_torch = normal.log_prob(xp.double()).flatten(1).mean(dim=1)
        _close(out.log_prob, by_torch, rtol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", SDE_KINDS)
def test_drawn_prev_sample_and_its_log_density(kind, shape):
    v, x, _ = _inputs(shape, seed=1)
    out = _step(kind, v, x, generator=torch.Generator().manual_seed(123))
    eps = torch.randn(shape, generator=torch.Generator().manual_seed(123), dtype=torch.float32).double().numpy()
    mean, std, _ = reference_step(kind, v.double().numpy(), x.double().numpy(), SIGMA, SIGMA_NEXT, NOISE[kind])
    _close(out.prev_sample, mean + std * eps)
    assert not out.prev_sample.requires_grad
    if kind == "flow_grpo_cps":
        # x' − μ = std·ε exactly, so log p = −mean(std²·ε²); zero at the last step (std = 0).
        _close(out.log_prob, -(std**2 * eps**2).reshape(shape[0], -1).mean(axis=1), rtol=1e-5, atol=1e-6)
        assert out.log_prob[2].item() == 0.0
        return
    xp64 = out.prev_sample.double().numpy()
    _close(out.log_prob, gaussian_log_prob(xp64, mean, std), rtol=1e-6, atol=1e-5)
    # A drawn sample's log-density is −½·mean ε² − log s − log sqrt(2π) up to the rounding of x'.
    by_noise = -0.5 * (eps**2).reshape(shape[0], -1).mean(axis=1) - np.log(std.reshape(-1)) - 0.5 * np.log(2 * np.pi)
    _close(out.log_prob, by_noise, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["flow_grpo", "flow_grpo_cps", "dance_grpo"])
def test_first_step_sigma_one_for_whole_batch(kind):
    shape = (2, 6, 4)
    v, x, xp = _inputs(shape, seed=2)
    sigma, sigma_next = np.ones(2), np.array([SIGMA_MAX, SIGMA_MAX])
    out = sde_step(
        kind, v, x, 1.0, SIGMA_MAX, noise_level=NOISE[kind], prev_sample=xp, sigma_max=SIGMA_MAX
    )
    mean, std, _ = reference_step(kind, v.double().numpy(), x.double().numpy(), sigma, sigma_next, NOISE[kind])
    assert np.isfinite(mean).all()
    _close(out.mean, mean)
    _close(out.std, std)
    if kind == "flow_grpo":
        # std_t = a·sqrt(1 / (1 − σ_1)) at σ = 1
        expected_std = NOISE[kind] * math.sqrt(1 / (1 - SIGMA_MAX)) * math.sqrt(1 - SIGMA_MAX)
        assert out.std.flatten()[0].item() == pytest.approx(expected_std, rel=1e-6)


def test_flow_grpo_sigma_one_needs_sigma_max():
    v, x, _ = _inputs((2, 3, 4))
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step("flow_grpo", v, x, torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.4]), noise_level=0.7)
    out = sde_step("flow_grpo", v, x, torch.tensor([0.8, 0.5]), torch.tensor([0.7, 0.4]), noise_level=0.7)
    assert torch.isfinite(out.log_prob).all()


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_per_sample_generators_reproduce_draws(kind):
    shape = (3, 5, 4)
    v, x, _ = _inputs(shape, seed=3)
    seeds = [10, 11, 12]
    batch = _step(kind, v, x, generator=[torch.Generator().manual_seed(s) for s in seeds])
    again = _step(kind, v, x, generator=[torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(batch.prev_sample, again.prev_sample)
    eps = torch.stack([torch.randn(shape[1:], generator=torch.Generator().manual_seed(s)) for s in seeds])
    _close(batch.prev_sample, batch.mean.detach().double() + batch.std.double() * eps.double())
    # Sample 1 alone, with its own generator, draws the same x' as inside the batch.
    alone = sde_step(
        kind,
        v[1:2],
        x[1:2],
        torch.tensor(SIGMA[1:2], dtype=torch.float32),
        torch.tensor(SIGMA_NEXT[1:2], dtype=torch.float32),
        noise_level=NOISE[kind],
        generator=[torch.Generator().manual_seed(11)],
        sigma_max=SIGMA_MAX,
        sigma_min=SIGMA_MIN,
    )
    assert torch.equal(alone.prev_sample[0], batch.prev_sample[1])
    assert torch.equal(alone.log_prob[0], batch.log_prob[1])


def test_flow_grpo_log_prob_gradient_matches_closed_form():
    shape = (3, 6, 5)
    v, x, xp = _inputs(shape, seed=4)
    v = v.clone().requires_grad_(True)
    out = _step("flow_grpo", v, x, prev_sample=xp)
    out.log_prob.sum().backward()
    mean, std, std_t = reference_step("flow_grpo", v.detach().double().numpy(), x.double().numpy(),
                                      SIGMA, SIGMA_NEXT, NOISE["flow_grpo"])
    s, dt = _bcast(SIGMA, 3), _bcast(SIGMA_NEXT - SIGMA, 3)
    n = np.prod(shape[1:])
    dmean_dv = (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    expected = (xp.double().numpy() - mean) / (std**2 * n) * dmean_dv
    _close(v.grad, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_transition_std_both_forms(kind):
    sigma = torch.tensor(SIGMA, dtype=torch.float32)
    sigma_next = torch.tensor(SIGMA_NEXT, dtype=torch.float32)
    out = transition_std(kind, sigma, sigma_next, NOISE[kind], sigma_max=SIGMA_MAX, sigma_min=SIGMA_MIN)
    zeros = np.zeros((3, 1))
    _, std, std_t = reference_step(kind, zeros, zeros, SIGMA, SIGMA_NEXT, NOISE[kind])
    _close(out.std, std.reshape(-1))
    _close(out.std_t, std_t.reshape(-1))
    if kind != "flow_grpo_cps":
        _close(out.std, out.std_t.double().numpy() * np.sqrt(SIGMA - SIGMA_NEXT))


def test_low_precision_inputs_give_float32_outputs():
    v, x, xp = (t.to(torch.bfloat16) for t in _inputs((2, 4, 4), seed=5))
    out = sde_step("dance_grpo", v, x, torch.tensor([0.8, 0.6]), torch.tensor([0.6, 0.4]), noise_level=0.3,
                   prev_sample=xp)
    assert all(t.dtype == torch.float32 for t in out)
    mean, _, _ = reference_step("dance_grpo", v.double().numpy(), x.double().numpy(),
                                np.array([0.8, 0.6]), np.array([0.6, 0.4]), 0.3)
    _close(out.mean, mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_ode_step(shape):
    v, x, _ = _inputs(shape, seed=6)
    out = ode_step(v, x, torch.tensor(SIGMA, dtype=torch.float32), torch.tensor(SIGMA_NEXT, dtype=torch.float32))
    expected = x.double().numpy() + v.double().numpy() * _bcast(SIGMA_NEXT - SIGMA, len(shape))
    _close(out, expected)


def test_errors():
    v, x, xp = _inputs((2, 3, 4))
    sig, sig_next = torch.tensor([0.8, 0.6]), torch.tensor([0.6, 0.4])
    with pytest.raises(ValueError, match="valid kinds: flow_grpo, flow_grpo_cps, wan, dance_grpo"):
        sde_step("ddim", v, x, sig, sig_next, noise_level=0.7)
    with pytest.raises(ValueError, match="needs sigma_max"):
        sde_step("wan", v, x, sig, sig_next, noise_level=1.0, sigma_min=0.0)
    with pytest.raises(ValueError, match="needs sigma_min"):
        sde_step("wan", v, x, sig, sig_next, noise_level=1.0, sigma_max=0.9)
    with pytest.raises(ValueError, match="differ in shape"):
        sde_step("flow_grpo", v[:, :2], x, sig, sig_next, noise_level=0.7)
    with pytest.raises(ValueError, match="prev_sample"):
        sde_step("flow_grpo", v, x, sig, sig_next, noise_level=0.7, prev_sample=xp[:1])
    with pytest.raises(ValueError, match=r"sigma must have shape \(2,\)"):
        sde_step("flow_grpo", v, x, torch.tensor([0.8, 0.6, 0.4]), sig_next, noise_level=0.7)
    with pytest.raises(ValueError, match="3 generators for a batch of 2"):
        sde_step("flow_grpo", v, x, sig, sig_next, noise_level=0.7, generator=[torch.Generator()] * 3)
    with pytest.raises(ValueError, match="not both"):
        sde_step("flow_grpo", v, x, sig, sig_next, noise_level=0.7, prev_sample=xp, generator=torch.Generator())
    with pytest.raises(ValueError, match="smaller than its sigma"):
        sde_step("dance_grpo", v, x, sig_next, sig, noise_level=0.3)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step("dance_grpo", v, x, sig, sig_next, noise_level=0.0)
