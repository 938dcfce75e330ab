import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from leangrpo_mcore.rl.loss import (
    POLICY_LOSSES,
    PolicyLossMetrics,
    available_policy_losses,
    compute_policy_loss,
    grpo_step_loss,
    kl_loss,
)

EPS = 0.2


def _tiny_log_prob(theta, x, target):
    """Gaussian log-density (mean over dims) of target under mean x @ theta, std 0.5: a parametrised log p."""
    mean = x @ theta
    s = 0.5
    return (-((target - mean) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).mean(dim=1)


def test_value_matches_closed_form():
    g = torch.Generator().manual_seed(0)
    log_prob = torch.randn(64, generator=g) * 0.3
    old = torch.randn(64, generator=g) * 0.3
    adv = torch.randn(64, generator=g)
    loss, _ = grpo_step_loss(log_prob, old, adv, clip_range=EPS)
    expected = []
    for lp, lo, a in zip(log_prob.tolist(), old.tolist(), adv.tolist(), strict=True):
        r = math.exp(lp - lo)
        expected.append(max(-a * r, -a * min(max(r, 1 - EPS), 1 + EPS)))
    assert loss.dtype == torch.float32 and loss.shape == (64,)
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_gradient_on_policy_is_minus_a_grad_log_prob():
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(5, 3, generator=g, requires_grad=True)
    x, target = torch.randn(4, 7, 5, generator=g), torch.randn(4, 7, 3, generator=g)
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0])
    log_prob = _tiny_log_prob(theta, x, target).mean(dim=1)
    loss, metrics = grpo_step_loss(log_prob, log_prob.detach(), adv, clip_range=1e-4)
    (grad,) = torch.autograd.grad(loss.sum(), theta)
    (expected,) = torch.autograd.grad((-adv * _tiny_log_prob(theta, x, target).mean(dim=1)).sum(), theta)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
    assert grad.abs().max() > 0.1
    torch.testing.assert_close(loss.detach(), -adv)
    assert float(metrics.ratio_mean) == 1.0 and float(metrics.clip_fraction) == 0.0


@pytest.mark.parametrize(
    "adv,log_ratio,clipped",
    [
        (1.0, math.log(1.5), True),  # A > 0, ρ above 1+ε: clipped, no gradient
        (1.0, math.log(0.5), False),  # A > 0, ρ below 1−ε: the unclipped term wins
        (-1.0, math.log(1.5), False),  # A < 0, ρ above 1+ε: the unclipped term wins
        (-1.0, math.log(0.5), True),  # A < 0, ρ below 1−ε: clipped, no gradient
    ],
)
def test_clipping_both_sides(adv, log_ratio, clipped):
    log_prob = torch.tensor([log_ratio], requires_grad=True)
    loss, metrics = grpo_step_loss(log_prob, torch.zeros(1), torch.tensor([adv]), clip_range=EPS)
    loss.sum().backward()
    ratio = math.exp(log_ratio)
    if clipped:
        bound = 1 + EPS if ratio > 1 else 1 - EPS
        assert loss.item() == pytest.approx(-adv * bound, rel=1e-6)
        assert log_prob.grad.item() == 0.0
    else:
        assert loss.item() == pytest.approx(-adv * ratio, rel=1e-6)
        assert log_prob.grad.item() == pytest.approx(-adv * ratio, rel=1e-6)
    assert float(metrics.clip_fraction) == 1.0


def test_metrics():
    log_prob = torch.tensor([0.0, 0.1, -0.3, 0.05], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    _, m = grpo_step_loss(log_prob, old, torch.ones(4), clip_range=0.08)
    ratios = torch.exp(log_prob.detach())
    assert isinstance(m, PolicyLossMetrics)
    assert float(m.clip_fraction) == pytest.approx(0.5)  # 0.1 and -0.3 are outside ±0.08
    assert float(m.approx_kl) == pytest.approx(0.5 * (0.01 + 0.09 + 0.0025) / 4, rel=1e-6)
    assert float(m.ratio_mean) == pytest.approx(ratios.mean().item(), rel=1e-6)
    assert float(m.ratio_min) == pytest.approx(math.exp(-0.3), rel=1e-6)
    assert float(m.ratio_max) == pytest.approx(math.exp(0.1), rel=1e-6)
    assert not m.approx_kl.requires_grad and m.approx_kl.ndim == 0
    assert set(m.as_floats()) == {"clip_fraction", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"}


def test_policy_loss_registry_and_errors():
    assert "grpo" in available_policy_losses() and POLICY_LOSSES["grpo"] is grpo_step_loss
    loss, _ = compute_policy_loss("grpo", torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -2.0]), clip_range=0.1)
    assert loss.tolist() == [-1.0, 2.0]
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; valid: grpo"):
        compute_policy_loss("ppo", torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.1)
    with pytest.raises(ValueError, match="shape"):
        grpo_step_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), clip_range=0.1)
    with pytest.raises(ValueError, match="clip_range"):
        grpo_step_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.0)


@pytest.mark.parametrize("shape", [(3, 16, 8), (2, 4, 3, 5, 6)])
def test_kl_forms_vs_closed_forms(shape):
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(shape, generator=g, dtype=torch.float64).float()
    ref = mean + 0.1 * torch.randn(shape, generator=g)
    std_t = torch.rand(shape[0], generator=g) + 0.3
    dt = -torch.rand(shape[0], generator=g) * 0.2 - 0.05
    s = std_t * torch.sqrt(-dt)
    dims = tuple(range(1, len(shape)))
    bshape = (-1,) + (1,) * (len(shape) - 1)

    flow = kl_loss(mean, ref, std_t=std_t, form="flow_grpo")
    expected_flow = ((mean - ref) ** 2).mean(dim=dims) / (2 * std_t**2)
    torch.testing.assert_close(flow, expected_flow, rtol=1e-5, atol=1e-8)

    exact = kl_loss(mean, ref, transition_std=s, form="exact")
    true_kl = kl_divergence(Normal(mean, s.reshape(bshape)), Normal(ref, s.reshape(bshape))).mean(dim=dims)
    torch.testing.assert_close(exact, true_kl, rtol=1e-5, atol=1e-8)
    # sde_step returns its std as (B, 1, ..., 1): the same numbers.
    torch.testing.assert_close(kl_loss(mean, ref, transition_std=s.reshape(bshape), form="exact"), exact)
    # FlowGRPO's SD3/FLUX form is |dt| times the true KL (s² = std_t²·|dt|).
    torch.testing.assert_close(flow, exact * (-dt), rtol=1e-5, atol=1e-8)
    assert exact.dtype == torch.float32 and exact.shape == (shape[0],)


def test_kl_gradient_and_errors():
    mean = torch.tensor([[1.0, 2.0]], requires_grad=True)
    ref = torch.tensor([[0.0, 0.0]])
    kl = kl_loss(mean, ref, std_t=torch.tensor([2.0]))
    kl.sum().backward()
    assert kl.item() == pytest.approx((1 + 4) / 2 / 8)
    torch.testing.assert_close(mean.grad, torch.tensor([[1.0, 2.0]]) / 8)  # d/dμ mean (μ−μref)²/(2·4)
    with pytest.raises(ValueError, match="takes std_t"):
        kl_loss(mean, ref, transition_std=torch.ones(1))
    with pytest.raises(ValueError, match="takes transition_std"):
        kl_loss(mean, ref, std_t=torch.ones(1), form="exact")
    with pytest.raises(ValueError, match="unknown KL form 'k3'"):
        kl_loss(mean, ref, std_t=torch.ones(1), form="k3")
    with pytest.raises(ValueError, match="> 0"):
        kl_loss(mean, ref, std_t=torch.zeros(1))
    with pytest.raises(ValueError, match="does not broadcast"):
        kl_loss(mean, ref, std_t=torch.ones(3))
