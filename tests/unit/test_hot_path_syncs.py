"""The training hot path reads nothing back from the device, and draws each row's SDE noise once per step.

"Device" tensors are emulated on the CPU by :class:`OnDevice`, a tensor subclass that every op propagates and that
logs each host read of its data (``bool``, ``item``, ``tolist``, ``nonzero``, boolean-mask indexing): each is a
blocking host sync on an accelerator. Host data (the selected steps, the SDE steps, the noise seeds) stays plain:
it is drawn before the rollout, and reading it costs nothing. The numbers are checked against the closed-form SDE
mean, the KL formula and the seeded draws, written here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from leangrpo_mcore.diffusion import sampler as sampler_module
from leangrpo_mcore.diffusion.lockstep import rollout_together
from leangrpo_mcore.diffusion.sampler import RolloutLoop, SDEParams
from leangrpo_mcore.diffusion.sde import transition_std
from leangrpo_mcore.diffusion.seeding import generator
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.parallel.grad_sync import GradSync
from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context
from leangrpo_mcore.schedules.base import Objective, ScheduleContext, kl_value, unit_loss
from leangrpo_mcore.schedules.reweight import ReweightSchedule

_HOST_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
               torch.Tensor.numpy, torch.masked_select, torch.Tensor.masked_select, torch.equal}


class OnDevice(torch.Tensor):
    """A tensor standing for device memory: logs every read of its data by the host (module doc)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        masked = func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_mask(args[1])
        if func in _HOST_READS or masked:
            cls.reads.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def _is_mask(index) -> bool:
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def dev(t: torch.Tensor) -> OnDevice:
    """``t`` as device data."""
    return t.as_subclass(OnDevice)


@contextlib.contextmanager
def host_reads():
    """The host reads of device data inside."""
    OnDevice.reads = []
    yield OnDevice.reads


def test_the_detector_sees_host_reads():
    x = dev(torch.tensor([0.8, 0.6]))
    with host_reads() as reads:
        bool((x < 1).all())
        x[x > 0.7]
        x.tolist()
        transition_std("flow_grpo", x, x - 0.1, 0.7, sigma_max=0.9, check=True)  # checks σ' < σ on the host
    assert reads == ["__bool__", "__getitem__", "tolist", "__bool__"]


def _unit(kind: str, kl_form: str, train: torch.Tensor):
    """One unit's loss on device data: the SDE step scoring x', its KL to a reference mean, the unit loss."""
    gen = torch.Generator().manual_seed(0)
    x, v, xp, ref = (torch.randn(3, 4, 5, generator=gen) for _ in range(4))
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.5]), torch.tensor([0.7, 0.5, 0.0])
    sde = SDEParams(kind, 0.3 if kind == "dance_grpo" else 0.7, sigma_max=0.9, sigma_min=0.0)
    objective = Objective(clip_range=0.2, kl_beta=0.5, kl_form=kl_form)
    v = dev(v).requires_grad_()
    with host_reads() as reads:
        out = sde.step(v, dev(x), dev(sigma), dev(sigma_next), prev_sample=dev(xp))
        kl = kl_value(sde, objective, out.mean, dev(ref), out.std, dev(sigma), dev(sigma_next))
        loss, ratio = unit_loss(out.log_prob, out.log_prob.detach(), dev(torch.full((3,), 2.0)), train, 0.25,
                                objective, kl)
        loss.backward()
    return list(reads), loss, ratio, (x, v.detach(), ref, sigma, sigma_next)


@pytest.mark.parametrize("kind,kl_form", [("flow_grpo", "flow_grpo"), ("flow_grpo", "exact"), ("wan", "exact"),
                                          ("dance_grpo", "flow_grpo")])
def test_a_unit_loss_reads_nothing_back(kind, kl_form):
    reads, _, ratio, _ = _unit(kind, kl_form, torch.tensor([True, False, True]))
    assert reads == []
    assert ratio.shape == (2,) and torch.equal(ratio, torch.ones(2))


def test_unit_loss_numbers_against_the_formula():
    train = torch.tensor([True, False, True])
    reads, loss, _, (x, v, ref, sigma, sigma_next) = _unit("flow_grpo", "flow_grpo", train)
    assert reads == []
    x, v, ref = x.double(), v.double(), ref.double()
    # FlowGRPO's std_t = a·sqrt(σ/(1 − σ)), σ = 1 replaced by σ_1 = 0.9 in the denominator, and its SDE mean
    sig, nxt = sigma.double().view(-1, 1, 1), sigma_next.double().view(-1, 1, 1)
    std_t = 0.7 * torch.sqrt(sig / (1 - torch.where(sig == 1, torch.full_like(sig, 0.9), sig)))
    dt = nxt - sig
    mean = x * (1 + std_t ** 2 * dt / (2 * sig)) + v * dt * (1 + std_t ** 2 * (1 - sig) / (2 * sig))
    kl = ((mean - ref) ** 2).mean(dim=(1, 2)) / (2 * std_t.flatten() ** 2)
    per_sample = -2.0 * 1.0 + 0.5 * kl  # on-policy: ρ = 1, advantage 2
    expected = 0.25 * per_sample[train].sum()
    assert abs(float(loss.detach()) - float(expected)) <= 1e-5 * abs(float(expected))


def test_cps_kl_keeps_its_one_check():
    """cps's transition std is 0 at σ' = 0: there the KL still reads its std back (and refuses it)."""
    with pytest.raises(ValueError, match="must be > 0"):
        _unit("flow_grpo_cps", "exact", torch.tensor([True, True, True]))


_SDE_STEPS = torch.tensor([[True, False, True, True], [False, True, True, True], [True, True, False, True]])
"""The SDE steps of the toy rollouts (each row also at step 3, which nobody trains); the others are trained."""


class _Toy(torch.nn.Module):
    """A velocity function of one linear layer, with the interface the schedules use."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = torch.nn.Linear(6, 6)
        torch.nn.init.normal_(self.policy.weight, std=0.3, generator=torch.Generator().manual_seed(1))

    def __call__(self, latents, sigma, conditioning):
        text = conditioning.encoder_hidden_states.mean(dim=(1, 2)).view(-1, 1, 1)
        return self.policy(latents) * sigma.view(-1, 1, 1) + text

    def reference(self):
        return contextlib.nullcontext()


def _loop(toy: _Toy, on_step=None) -> RolloutLoop:
    batch, steps = 3, 4
    sigmas = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0])
    selected = _SDE_STEPS & torch.tensor([True, True, True, False])
    sde_steps = _SDE_STEPS
    cond = Conditioning(encoder_hidden_states=dev(torch.randn(batch, 2, 3, generator=torch.Generator().manual_seed(2))))
    seeds = torch.arange(100, 100 + batch * steps, dtype=torch.long).view(batch, steps)
    init = dev(torch.randn(batch, 4, 6, generator=torch.Generator().manual_seed(3)))
    return RolloutLoop(init, sigmas, cond, sde=SDEParams("flow_grpo", 0.7, 0.8, 0.0), selected=selected,
                       sde_steps=sde_steps, noise_seeds=seeds, prompt_ids=torch.zeros(batch, dtype=torch.long),
                       generation_ids=torch.arange(batch), grad_steps=selected, on_step=on_step,
                       per_sample_grad=True)


def _drawn(monkeypatch) -> list[tuple[int, int]]:
    """(step, row) of every SDE noise draw of the sampler."""
    drawn, real = [], sampler_module.step_noise

    def counted(noise_seeds, t, rows, shape):
        drawn.extend((t, r) for r in rows)
        return real(noise_seeds, t, rows, shape)

    monkeypatch.setattr(sampler_module, "step_noise", counted)
    return drawn


def _once_per_sde_step(drawn: list[tuple[int, int]]) -> bool:
    """Whether every (step, row) of an SDE step was drawn, and none twice (a forward's rows without one draw none)."""
    sde = {(t, r) for r, row in enumerate(_SDE_STEPS.tolist()) for t, on in enumerate(row) if on}
    return len(drawn) == len(set(drawn)) and set(drawn) >= sde


def test_reweight_rollout_reads_nothing_back_and_draws_each_noise_once(monkeypatch):
    drawn = _drawn(monkeypatch)
    toy = _Toy()
    sync = GradSync(toy.policy, build_parallel_context(Layout()), mode="coalesced")
    schedule = ReweightSchedule(ScheduleContext(velocity_fn=toy, sde=SDEParams("flow_grpo", 0.7, 0.8, 0.0),
                                                objective=Objective(), grad_sync=sync))
    schedule.begin_update(0.125)
    with host_reads() as reads:
        loop = _loop(toy, schedule.on_step((0, 0), None))
        while not loop.done:
            loop.step(toy)
    assert reads == []
    assert _once_per_sde_step(drawn), drawn
    traj = loop.trajectory()
    # the seeded draw, independently: x_{t+1} = μ + s·ε with ε from the (row, step) seed; here row 2 at step 3
    # (an untrained SDE step), μ and s from the step's own formula
    x, sig, nxt = traj.latents[2:3, 3], torch.tensor([0.3]), torch.tensor([0.0])
    with torch.no_grad():
        out = SDEParams("flow_grpo", 0.7, 0.8, 0.0).step(toy(x, sig, loop.conditioning.select([2])), x, sig, nxt,
                                                         prev_sample=x)
    eps = torch.randn(4, 6, generator=generator(100 + 2 * 4 + 3))
    assert torch.allclose(traj.next_latents[2, 3], out.mean[0] + out.std[0] * eps, rtol=0, atol=1e-6)
    assert schedule.stats.max_local_grad_buffers == 3  # each sample's provisional gradient, one of them in the slot


def test_rows_trained_elsewhere_draw_each_noise_once(monkeypatch):
    """The pipeline stages' path: each trained row's step is formed for its loss and its KL part, then taken."""
    drawn = _drawn(monkeypatch)
    toy = _Toy()
    reference = _loop(toy)
    while not reference.done:
        reference.step(toy)
    loop = _loop(toy)

    def train_rows(rows):
        velocities = [toy(row.latents, row.sigma, row.conditioning).detach() for row in rows]
        for row, velocity in zip(rows, velocities):
            row.record(velocity)  # the KL part's step
            row.record(velocity)  # the policy-gradient part's step
        return velocities

    many = lambda requests: [toy(*request) for request in requests]  # noqa: E731
    drawn.clear()
    with host_reads() as reads:
        rollout_together([loop], toy, many, train_rows=train_rows)
    assert reads == []
    assert _once_per_sde_step(drawn), drawn
    assert torch.equal(loop.trajectory().next_latents, reference.trajectory().next_latents)


def test_reweight_moves_each_sample_gradient_in_one_pass(monkeypatch):
    """Per sample-step one pass over the parameters (the previous sample's gradient out, this one's in), and each
    sample's provisional gradient is the sum of its own backwards (torch.autograd.grad, written here)."""
    toy = _Toy()
    sync = GradSync(toy.policy, build_parallel_context(Layout()), mode="coalesced")
    passes = []
    for name in ("swap_local", "take_local", "put_local"):
        real = getattr(GradSync, name)
        monkeypatch.setattr(GradSync, name, lambda self, *a, _real=real, _name=name: (passes.append(_name),
                                                                                       _real(self, *a))[1])
    schedule = ReweightSchedule(ScheduleContext(velocity_fn=toy, sde=SDEParams("flow_grpo", 0.7, 0.8, 0.0),
                                                objective=Objective(), grad_sync=sync))
    schedule.begin_update(1.0)
    gen = torch.Generator().manual_seed(4)
    inputs = {sample: [torch.randn(2, 6, generator=gen) for _ in range(3)] for sample in range(2)}
    for step in range(3):
        for sample in range(2):
            loss = toy.policy(inputs[sample][step]).square().sum()
            schedule._backward_into(schedule._partial, (0, 0, sample), loss, False)
    assert passes == ["swap_local"] * 6  # nothing taken out or put back around each backward
    schedule._settle()
    for sample in range(2):
        loss = sum(toy.policy(x).square().sum() for x in inputs[sample])
        expected = torch.autograd.grad(loss, list(toy.policy.parameters()))
        for got, want in zip(schedule._partial[(0, 0, sample)], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
