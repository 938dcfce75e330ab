"""Native's gradient with the KL term against the whole GRPO objective written out here in float64.

A toy policy whose velocity is linear in its LoRA adapters, v = x·(W + s·B·A)ᵀ + b + σ·c, runs one training step
through the step engine (rollout, rewards, advantages, Native's recompute, no clipping). The test then writes the
objective of docs/algorithms.md §2 and §4 from the formulas alone: the flow_grpo SDE mean and Gaussian
log-density, the clipped surrogate at ratio 1, the KL to the adapter-free reference on the SDE means (divided by
2·std_t² in the ``flow_grpo`` form, by 2·s² in the ``exact`` form), the group advantages, and the one loss weight
1 / (samples × selected steps); float64 autograd of it must give the gradient the optimizer received and the
update loss the engine reported. Every schedule-level KL check elsewhere is relative (schedule against schedule,
N ranks against 1), so this is the one that pins the KL's value.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from leangrpo_mcore.diffusion.sampler import SDEParams
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.engine import StepEngine, StepInputs, StepPlan
from leangrpo_mcore.models.common.lora import AdapterHostMixin, LoRAConfig, apply_lora, mark_only_lora_trainable
from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context
from leangrpo_mcore.schedules import Objective

TOKENS, CHANNELS = 4, 3
NOISE_LEVEL = 0.9
CLIP = 1e-4
# per KL form, a β at which the KL and the policy-gradient parts of the gradient are of one size (the exact form
# divides by 2·s², smaller than flow_grpo's 2·std_t², so its KL is the larger)
BETA = {"flow_grpo": 1.0, "exact": 0.2}
PROMPTS, GROUP, STEPS = 2, 4, 4


class ToyLinear(torch.nn.Module, AdapterHostMixin):
    """A plain linear that LoRA can adapt (the adapter term is the library's; the test writes its own)."""

    parallel_mode = "replicated"

    def __init__(self, features: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.weight = torch.nn.Parameter(0.5 * torch.randn(features, features, generator=gen))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(features, generator=gen))
        self.full_in_features = self.full_out_features = features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ + b plus the adapter term."""
        return self.add_adapter_output(x, torch.nn.functional.linear(x, self.weight, self.bias))


class ToyPolicy(torch.nn.Module):
    """v(x, σ, c) = proj(x) + σ·c, c the first conditioning token."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = ToyLinear(CHANNELS)

    def forward(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B, TOKENS, CHANNELS) float32 velocity."""
        cond = conditioning.encoder_hidden_states[:, :1, :]
        return self.proj(latents) + sigma.view(-1, 1, 1) * cond


class ToyVelocity:
    """The velocity-function protocol over :class:`ToyPolicy`; the reference disables the adapters."""

    def __init__(self, policy: ToyPolicy) -> None:
        self.policy = policy

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """The policy's float32 velocity."""
        return self.policy(latents, sigma, conditioning)

    @contextlib.contextmanager
    def reference(self):
        """The adapter-free policy."""
        host = self.policy.proj
        host.lora_enabled = False
        try:
            yield
        finally:
            host.lora_enabled = True


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it steps with."""

    recorded: list

    def step(self, closure=None):
        self.recorded = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def _reward(final: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.0, final[0].numel(), dtype=final.dtype)
    return (final.flatten(1) * weights).sum(1) + 0.1 * prompt_ids.to(final.dtype)


def _policy() -> ToyPolicy:
    policy = ToyPolicy()
    apply_lora(policy, LoRAConfig(rank=2, alpha=4.0, targets=("proj",)), seed=0)
    mark_only_lora_trainable(policy)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B starts at 0 (policy == reference): make the KL term live
        policy.proj.lora_B.weight.copy_(0.5 * torch.randn(policy.proj.lora_B.weight.shape, generator=gen))
    return policy


def _run_step(kl_form: str):
    """One Native step on the toy policy: (policy before the step, recorded gradients, step result)."""
    policy = _policy()
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    sigmas = get_sigmas("flux", STEPS, image_seq_len=TOKENS)
    plan = StepPlan(
        schedule="native", group_size=GROUP, prompts_per_step=PROMPTS, latent_shape=(TOKENS, CHANNELS),
        sigmas=sigmas, sde=SDEParams.from_sigmas("flow_grpo", NOISE_LEVEL, sigmas),
        objective=Objective(clip_range=CLIP, kl_beta=BETA[kl_form], kl_form=kl_form),
        selection={"method": "flow_grpo", "fraction": 0.99}, micro_batch=2, max_grad_norm=0.0, seed=3)
    ctx = build_parallel_context(Layout())
    try:
        optimizer = RecordingSGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
        engine = StepEngine(plan, policy=policy, velocity_fn=ToyVelocity(policy), ctx=ctx, optimizer=optimizer,
                            reward_fn=_reward, keep_trajectories=True)
        gen = torch.Generator().manual_seed(11)
        cond = Conditioning(encoder_hidden_states=torch.randn(PROMPTS, 2, CHANNELS, generator=gen))
        result = engine.step(StepInputs(step=2, conditioning=cond, prompt_ids=torch.arange(PROMPTS)))
    finally:
        destroy_parallel_context()
    names = [name for name, p in policy.named_parameters() if p.requires_grad]
    return before, dict(zip(names, optimizer.recorded)), result, sigmas


def _std_t(sigma: torch.Tensor, sigma_1: float) -> torch.Tensor:
    """FlowGRPO's std_t = a·sqrt(σ / (1 − σ̃)), σ̃ = σ_1 where σ = 1."""
    denom = torch.where(sigma == 1, torch.full_like(sigma, sigma_1), sigma)
    return NOISE_LEVEL * torch.sqrt(sigma / (1 - denom))


def _objective(params: dict, result, sigma_1: float, kl_form: str, beta: float) -> torch.Tensor:
    """The update loss in float64: mean over (sample, selected step) of max(−Aρ, −A·clip(ρ)) + β·KL."""
    w, b = params["proj.weight"], params["proj.bias"]
    lora_a, lora_b = params["proj.lora_A.weight"], params["proj.lora_B.weight"]
    scale = 4.0 / 2
    total, pairs, samples = torch.zeros((), dtype=torch.float64), 0, 0
    for slot in sorted(result.trajectories):
        trajs = result.trajectories[slot]
        finals = torch.cat([t.final_latents for t in trajs]).double()
        rewards = _reward(finals, torch.full((finals.shape[0],), slot))
        # the group's rewards are the engine's (the rows are this prompt's generations)
        engine_rewards = result.rewards[slot].double().sort().values
        torch.testing.assert_close(rewards.sort().values, engine_rewards, rtol=1e-5, atol=1e-6)
        advantages = ((rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)).clamp(-5.0, 5.0)
        rows = [(traj, i) for traj in trajs for i in range(traj.num_samples)]
        samples += len(rows)
        for adv, (traj, i) in zip(advantages, rows):
            c = traj.conditioning.encoder_hidden_states[i, 0].double()
            for t in range(traj.num_steps):
                if not bool(traj.selected[i, t]):
                    continue
                pairs += 1
                x, x_next = traj.latents[i, t].double(), traj.next_latents[i, t].double()
                sigma, sigma_next = traj.sigmas[i, t].double(), traj.sigmas[i, t + 1].double()
                dt = sigma_next - sigma
                std_t = _std_t(sigma, sigma_1)
                s = std_t * torch.sqrt(-dt)

                def mean_of(v):
                    return x * (1 + std_t**2 * dt / (2 * sigma)) + v * dt * (1 + std_t**2 * (1 - sigma) / (2 * sigma))

                base = x @ w.T + b + sigma * c
                mu = mean_of(base + scale * (x @ lora_a.T) @ lora_b.T)
                mu_ref = mean_of(base).detach()
                log_p = (-(x_next - mu) ** 2 / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean()
                ratio = torch.exp(log_p - log_p.detach())
                surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
                kl_std = std_t if kl_form == "flow_grpo" else s
                kl = ((mu - mu_ref) ** 2 / (2 * kl_std**2)).mean()
                total = total + surrogate + beta * kl
    assert samples == PROMPTS * GROUP and pairs == samples * int(0.99 * STEPS)  # every sample, 3 steps each
    return total / pairs


def _reference_grads(before: dict, result, sigmas: torch.Tensor, kl_form: str, beta: float):
    params = {name: p.double().requires_grad_(name.endswith(("lora_A.weight", "lora_B.weight")))
              for name, p in before.items()}
    loss = _objective(params, result, float(sigmas[1]), kl_form, beta)
    trained = [name for name, p in params.items() if p.requires_grad]
    grads = torch.autograd.grad(loss, [params[name] for name in trained])
    return float(loss.detach()), dict(zip(trained, grads))


def _norm(tensors: dict) -> float:
    return sum(float(t.pow(2).sum()) for t in tensors.values()) ** 0.5


def _rel(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() - want[k]).pow(2).sum()) for k in want)
    return (num / sum(float(want[k].pow(2).sum()) for k in want)) ** 0.5


@pytest.mark.parametrize("kl_form", ["flow_grpo", "exact"])
def test_native_gradient_with_kl_is_the_objective_written_out(kl_form):
    before, grads, result, sigmas = _run_step(kl_form)
    assert sorted(grads) == ["proj.lora_A.weight", "proj.lora_B.weight"]
    loss, want = _reference_grads(before, result, sigmas, kl_form, BETA[kl_form])
    _, policy_part = _reference_grads(before, result, sigmas, kl_form, 0.0)
    # the KL part is a large share of the gradient, so a KL off by a constant factor moves it far past the tolerance
    kl_part = {k: want[k] - policy_part[k] for k in want}
    assert _norm(kl_part) > 0.2 * _norm(want) and _norm(policy_part) > 0.2 * _norm(want)
    assert _rel(grads, want) < 1e-5
    # on-policy, each group's advantages sum to ~0, so the update loss is the β-weighted mean KL
    assert result.updates[0].loss == pytest.approx(loss, rel=1e-5)
    assert loss > 0
    low, high = result.updates[0].ratio_min, result.updates[0].ratio_max
    assert abs(low - 1) < 1e-6 and abs(high - 1) < 1e-6
