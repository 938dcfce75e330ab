"""Measured peak memory of one training step (CPU allocator, via MemoryMeter) behaves as LeanGRPO says:
Native flat in |S|, Retain growing linearly with |S|, Reweight flat in |S| plus one full gradient per
in-flight sample, and affine Reweight flat in the number of in-flight samples."""

from __future__ import annotations

import pytest

from tests.once import once_per_process
import torch

from leangrpo_mcore.diffusion.sampler import SDEParams
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.engine import StepEngine, StepInputs, StepPlan
from leangrpo_mcore.parallel.memory import MemoryMeter
from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context
from leangrpo_mcore.schedules import Objective

TOKENS, CHANNELS, HIDDEN, STEPS = 128, 16, 256, 4


class ToyVelocity(torch.nn.Module):
    """A token-wise MLP velocity network: few ops (cheap to profile), activations ~ a gradient in size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(CHANNELS + 1, HIDDEN), torch.nn.GELU(),
                                       torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                                       torch.nn.Linear(HIDDEN, CHANNELS))

    def forward(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        time = sigma.view(-1, 1, 1).expand(-1, latents.shape[1], 1)
        return self.net(torch.cat([latents, time], dim=-1))

    def reference(self):
        raise ValueError("no reference policy")


@pytest.fixture(scope="module")
@once_per_process
def policy():
    return ToyVelocity()


def _peak(policy, schedule: str, selected: int, group: int, accumulate: str = "per_sample") -> int:
    sigmas = get_sigmas("sd3", STEPS, shift=3.0)
    plan = StepPlan(schedule=schedule, group_size=group, prompts_per_step=1, latent_shape=(TOKENS, CHANNELS),
                    sigmas=sigmas, sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas), objective=Objective(),
                    selection={"method": "flow_grpo", "fraction": selected / STEPS}, reweight_accumulate=accumulate)
    # lr = 0: the shared policy never changes between measurements
    engine = StepEngine(plan, policy=policy, velocity_fn=policy, ctx=build_parallel_context(Layout()),
                        optimizer=torch.optim.SGD(policy.parameters(), lr=0.0),
                        reward_fn=lambda final, ids: final.flatten(1).sum(1), measure_memory=True)
    cond = Conditioning(encoder_hidden_states=torch.zeros(1, 1, 1))
    return engine.step(StepInputs(step=0, conditioning=cond, prompt_ids=torch.zeros(1, dtype=torch.long))).peak_memory_bytes


def test_meter_measures_allocations():
    with MemoryMeter() as meter:
        a = torch.zeros(1000)
        b = torch.zeros(3000)
        del a, b
        c = torch.zeros(500)
    assert meter.peak_bytes == 16000 and meter.end_bytes == 2000
    del c


def test_peak_memory_per_schedule(policy):
    grad = sum(p.numel() * p.element_size() for p in policy.parameters())
    _peak(policy, "native", 2, 2)  # warm-up: lazily built tables and caches are not part of any schedule
    native = [_peak(policy, "native", s, 2) for s in (2, 3)]
    retain = [_peak(policy, "retain", s, 2) for s in (1, 2, 3)]
    reweight = [_peak(policy, "reweight", s, 2) for s in (2, 3)]
    reweight_more = _peak(policy, "reweight", 2, 4)
    affine = [_peak(policy, "reweight", 2, m, "affine") for m in (4, 6)]
    # Native: one unit's activations + the gradient, whatever |S|
    assert abs(native[1] - native[0]) < 0.05 * grad
    # Retain: every kept graph stays until the reward, so memory grows by the same amount per selected step
    step_cost = retain[2] - retain[1]
    assert step_cost > grad and abs((retain[1] - retain[0]) - step_cost) < 0.15 * step_cost
    assert retain[2] > native[1] + step_cost
    # Stored trajectories (x_t, x_{t+1} and the final latent: 2T + 1 latents per sample) grow with the samples.
    latent = TOKENS * CHANNELS * 4
    trajectory = (2 * STEPS + 1) * latent
    # Reweight: flat in |S| (its peak comes one step later, when the rollout holds one more latent) ...
    assert abs(reweight[1] - reweight[0] - latent) < 0.02 * grad
    # ... plus one provisional gradient per in-flight sample (2 → 4 generations of the prompt on this rank)
    assert abs((reweight_more - reweight[0]) - 2 * (grad + trajectory)) < 0.05 * grad
    # affine accumulation: two accumulators, independent of the samples in flight
    assert abs(affine[1] - affine[0] - 2 * trajectory) < 0.05 * grad
    assert affine[1] < reweight_more
