"""GRPO-Guard (RatioNorm and the per-step gradient reweighting) against its objective written out here in float64.

The toy LoRA policy of ``test_native_closed_form.py`` runs one training step of two updates (``updates_per_rollout:
2``, one prompt group each) through the step engine with Native, in FlowGRPO's SDE with the flow_grpo weight and in
DanceGRPO's SDE with the dancegrpo weight. The test writes the objective from the formulas of docs/algorithms.md
§9 alone: per trained (sample, step) the SDE mean and log-density of the current parameters and of the rollout's
(computed here from the parameters before the first optimizer step), RatioNorm's
ρ̃ = exp((log p − log p_old + mean_d (μ − μ_old)² / (2 s²))·s), the clipped surrogate times the step's weight
(1/|dt| in FlowGRPO's σ form, 1/(|dt|·(1 + η²(1 − σ)/(2σ))) in DanceGRPO's), plus the unweighted KL, averaged
over the update's pairs. Its float64 gradient at each update's parameters must be the gradient the optimizer
received, and its value the update loss. The first update is on-policy (ρ̃ = 1, the drift term's gradient 0); the
second runs after a large SGD step, where the drift term and the clipping act.
"""

from __future__ import annotations

import math

import pytest
import torch

from leangrpo_mcore.diffusion.sampler import SDEParams
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.engine import StepEngine, StepInputs, StepPlan
from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context
from leangrpo_mcore.schedules import Objective
from tests.unit.test_native_closed_form import CHANNELS, TOKENS, ToyVelocity, _policy, _reward

PROMPTS, GROUP, STEPS = 2, 4, 4
CLIP, BETA, LR = 0.05, 0.5, 2.0
FORMS = {"flow_grpo": ("flow_grpo", 0.9, "flux"), "dancegrpo": ("dance_grpo", 0.3, "dance")}
"""grpo.grad_reweight -> (SDE kind, noise level, sigma schedule)."""


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the parameters and the gradients of every step."""

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        self.recorded = getattr(self, "recorded", []) + [([p.detach().clone() for p in params],
                                                          [p.grad.detach().clone() for p in params])]
        return super().step(closure)


def _sigmas(schedule: str) -> torch.Tensor:
    return get_sigmas("flux", STEPS, image_seq_len=TOKENS) if schedule == "flux" else get_sigmas("dance", STEPS)


def _run_step(form: str):
    kind, noise, schedule = FORMS[form]
    policy = _policy()
    sigmas = _sigmas(schedule)
    plan = StepPlan(
        schedule="native", group_size=GROUP, prompts_per_step=PROMPTS, latent_shape=(TOKENS, CHANNELS), sigmas=sigmas,
        sde=SDEParams.from_sigmas(kind, noise, sigmas),
        objective=Objective(clip_range=CLIP, kl_beta=BETA, ratio_norm=True, grad_reweight=form),
        selection={"method": "flow_grpo", "fraction": 0.99}, micro_batch=2, updates_per_rollout=2, max_grad_norm=0.0,
        seed=3)
    ctx = build_parallel_context(Layout())
    try:
        optimizer = RecordingSGD([p for p in policy.parameters() if p.requires_grad], lr=LR)
        engine = StepEngine(plan, policy=policy, velocity_fn=ToyVelocity(policy), ctx=ctx, optimizer=optimizer,
                            reward_fn=_reward, keep_trajectories=True)
        gen = torch.Generator().manual_seed(11)
        cond = Conditioning(encoder_hidden_states=torch.randn(PROMPTS, 2, CHANNELS, generator=gen))
        result = engine.step(StepInputs(step=2, conditioning=cond, prompt_ids=torch.arange(PROMPTS)))
    finally:
        destroy_parallel_context()
    frozen = {name: p.detach().clone() for name, p in policy.named_parameters() if not p.requires_grad}
    trained = [name for name, p in policy.named_parameters() if p.requires_grad]
    updates = [({**frozen, **dict(zip(trained, params))}, dict(zip(trained, grads)))
               for params, grads in optimizer.recorded]
    return updates, result, sigmas


def _step_math(params: dict, x, sigma, sigma_next, c, kind: str, noise: float, sigma_1: float, adapters: bool = True):
    """(μ, s, std_t) of the SDE step at ``params`` in float64 (FlowGRPO's or DanceGRPO's σ form)."""
    dt = sigma_next - sigma
    if kind == "flow_grpo":
        denom = sigma_1 if float(sigma) == 1.0 else sigma
        std_t = noise * torch.sqrt(sigma / (1 - denom))
    else:
        std_t = torch.tensor(noise, dtype=torch.float64)
    v = x @ params["proj.weight"].double().T + params["proj.bias"].double() + sigma * c
    if adapters:
        v = v + 2.0 * (x @ params["proj.lora_A.weight"].double().T) @ params["proj.lora_B.weight"].double().T
    mu = x * (1 + std_t**2 * dt / (2 * sigma)) + v * dt * (1 + std_t**2 * (1 - sigma) / (2 * sigma))
    return mu, std_t * torch.sqrt(-dt), std_t


def _log_p(x_next, mu, s):
    return (-(x_next - mu) ** 2 / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean()


def _objective(params: dict, old: dict, result, update: int, form: str, *, drift: float = 1.0,
               weighted: bool = True) -> tuple[torch.Tensor, list[float]]:
    """Update ``update``'s loss in float64 at ``params`` (the rollout's at ``old``), and its ratios ρ̃."""
    kind, noise, _ = FORMS[form]
    slot = update  # one prompt group per update
    trajs = result.trajectories[slot]
    finals = torch.cat([t.final_latents for t in trajs]).double()
    rewards = _reward(finals, torch.full((finals.shape[0],), slot))
    advantages = ((rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)).clamp(-5.0, 5.0)
    rows = [(traj, i) for traj in trajs for i in range(traj.num_samples)]
    total, ratios, pairs = torch.zeros((), dtype=torch.float64), [], 0
    for adv, (traj, i) in zip(advantages, rows):
        c = traj.conditioning.encoder_hidden_states[i, 0].double()
        sigma_1 = float(traj.sigmas[i, 1])
        for t in traj.selected_steps(i):
            pairs += 1
            x, x_next = traj.latents[i, t].double(), traj.next_latents[i, t].double()
            sigma, sigma_next = traj.sigmas[i, t].double(), traj.sigmas[i, t + 1].double()
            mu, s, std_t = _step_math(params, x, sigma, sigma_next, c, kind, noise, sigma_1)
            with torch.no_grad():
                mu_old, _, _ = _step_math(old, x, sigma, sigma_next, c, kind, noise, sigma_1)
                mu_ref, _, _ = _step_math(params, x, sigma, sigma_next, c, kind, noise, sigma_1, adapters=False)
            bias = ((mu - mu_old) ** 2).mean() / (2 * s**2)
            ratio = torch.exp((_log_p(x_next, mu, s) - _log_p(x_next, mu_old, s) + drift * bias) * s)
            surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
            dt = sigma - sigma_next
            weight = 1 / dt if form == "flow_grpo" else 1 / (dt * (1 + noise**2 * (1 - sigma) / (2 * sigma)))
            kl = ((mu - mu_ref) ** 2 / (2 * std_t**2)).mean()
            total = total + surrogate * (weight if weighted else 1.0) + BETA * kl
            ratios.append(float(ratio.detach()))
    assert pairs == GROUP * int(0.99 * STEPS)
    return total / pairs, ratios


def _reference(updates, result, update: int, form: str, **switches):
    params = {name: p.double().requires_grad_(name.endswith(("lora_A.weight", "lora_B.weight")))
              for name, p in updates[update][0].items()}
    loss, ratios = _objective(params, updates[0][0], result, update, form, **switches)
    trained = [name for name, p in params.items() if p.requires_grad]
    grads = torch.autograd.grad(loss, [params[name] for name in trained])
    return float(loss.detach()), dict(zip(trained, grads)), ratios


def _rel(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() - want[k]).pow(2).sum()) for k in want)
    return (num / sum(float(want[k].pow(2).sum()) for k in want)) ** 0.5


@pytest.fixture(scope="module", params=sorted(FORMS))
def guarded(request):
    form = request.param
    return form, *_run_step(form)


def test_loss_and_gradient_are_the_objective_written_out(guarded):
    form, updates, result, _ = guarded
    assert len(updates) == 2 and len(result.updates) == 2
    for k in range(2):
        loss, want, ratios = _reference(updates, result, k, form)
        assert _rel(updates[k][1], want) < 1e-5
        assert result.updates[k].loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
        assert result.updates[k].ratio_min == pytest.approx(min(ratios), rel=1e-5)
        assert result.updates[k].ratio_max == pytest.approx(max(ratios), rel=1e-5)
        # no ratio within float rounding of the clip band's edges (f32 and f64 agree on which are clipped)
        assert min(abs(abs(r - 1) - CLIP) for r in ratios) > 1e-4
    on_policy = _reference(updates, result, 0, form)[2]
    assert max(abs(r - 1) for r in on_policy) < 1e-6
    later = _reference(updates, result, 1, form)[2]
    assert sum(abs(r - 1) > CLIP for r in later) >= 1 and sum(abs(r - 1) <= CLIP for r in later) >= 1


def test_both_parts_are_real_terms_of_the_gradient(guarded):
    """Dropping RatioNorm's drift term (off-policy) or the step weights moves the gradient far past the tolerance."""
    form, updates, result, _ = guarded
    _, want, _ = _reference(updates, result, 1, form)
    assert _rel(updates[1][1], _reference(updates, result, 1, form, drift=1.5)[1]) > 1e-3
    assert _rel(updates[0][1], _reference(updates, result, 0, form, weighted=False)[1]) > 1e-1
    assert _rel(updates[1][1], want) < 1e-5


def test_per_step_ratio_metrics_pool_the_updates(guarded):
    from leangrpo_mcore.engine.output.metrics import per_step_ratios

    form, updates, result, _ = guarded
    ratios = [_reference(updates, result, k, form)[2] for k in range(2)]
    row = per_step_ratios(result.updates)
    assert sorted(row) == sorted(f"{key}.step_{t}" for key in ("ratio_mean", "clip_fraction") for t in range(3))
    # every update trains steps 0..2 of each of its 4 samples, pairs in sample-major order
    for t in range(3):
        pooled = [r[3 * i + t] for r in ratios for i in range(GROUP)]
        assert row[f"ratio_mean.step_{t}"] == pytest.approx(sum(pooled) / len(pooled), rel=1e-5)
        assert row[f"clip_fraction.step_{t}"] == sum(abs(r - 1) > CLIP for r in pooled) / len(pooled)
