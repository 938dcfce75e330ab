"""The rollout loop and the velocity adapters (stand-in policies, no model)."""

from __future__ import annotations

import pytest
import torch

from leangrpo_mcore.diffusion.draws import draw_rollout_inputs
from leangrpo_mcore.diffusion.lockstep import rollout_together
from leangrpo_mcore.diffusion.sampler import RolloutLoop, SDEParams, rollout
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import FluxVelocity, WanVelocity, flux_image_ids, pack_flux_latents, unpack_flux_latents


class RowWise(torch.nn.Module):
    """A per-sample velocity (no interaction between rows), so micro-batching cannot change any bit."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, latents, sigma, conditioning):
        return torch.tanh(latents * self.scale + sigma.view(-1, 1, 1)) - latents

    def reference(self):
        raise ValueError("no reference")


def _inputs(gens, method="flow_grpo", **sel):
    sel.setdefault("fraction", 0.99)
    return draw_rollout_inputs(base_seed=1, step=2, prompt_slots=[0] * len(gens), generation_ids=gens,
                               latent_shape=(3, 4), num_steps=4, selection={"method": method, **sel})


def _roll(model, draws, gens, **kw):
    sigmas = get_sigmas("sd3", 4)
    return rollout(model, draws.init_latents, sigmas, Conditioning(encoder_hidden_states=torch.zeros(len(gens), 1, 1)),
                   sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas), selected=draws.selected,
                   sde_steps=draws.sde_steps, noise_seeds=draws.noise_seeds, prompt_ids=torch.zeros(len(gens)),
                   generation_ids=torch.tensor(gens), **kw)


def test_rollout_records_and_graphs_only_where_asked():
    model, gens = RowWise(), [0, 1, 2]
    draws = _inputs(gens, fraction=0.5)
    records = []
    traj = _roll(model, draws, gens, grad_steps=draws.selected, on_step=records.append)
    traj.validate()
    assert [r.grad for r in records] == [True, True, False, False]
    assert records[0].sde.log_prob.requires_grad and not records[2].sde.log_prob.requires_grad
    assert not traj.latents.requires_grad and traj.latents.dtype == torch.float32
    assert torch.equal(traj.latents[:, 1:], traj.next_latents[:, :-1])
    assert torch.equal(traj.final_latents, traj.next_latents[:, -1])
    # the Native premise: scoring the stored x_{t+1} again gives the recorded log-prob, bit for bit
    sde = SDEParams.from_sigmas("flow_grpo", 0.7, get_sigmas("sd3", 4))
    for t in range(4):
        v = model(traj.latents[:, t], traj.sigmas[:, t], None)
        again = sde.step(v, traj.latents[:, t], traj.sigmas[:, t], traj.sigmas[:, t + 1],
                         prev_sample=traj.next_latents[:, t])
        assert torch.equal(again.log_prob, traj.log_probs[:, t])
    no_grad = _roll(model, draws, gens)
    assert torch.equal(no_grad.next_latents, traj.next_latents)
    flags = []
    _roll(model, draws, gens, grad_steps={1, 3}, on_step=lambda r: flags.append(r.grad))
    assert flags == [False, True, False, True]


def test_per_sample_grad_runs_each_trained_row_alone_and_keeps_the_trajectory():
    model, gens = RowWise(), [0, 1, 2]
    draws = _inputs(gens, fraction=0.5)  # steps 0 and 1 trained by every row
    calls = []
    counted = lambda x, s, c: calls.append((x.shape[0], torch.is_grad_enabled())) or model(x, s, c)
    records = []
    traj = _roll(counted, draws, gens, grad_steps=draws.selected, on_step=records.append, per_sample_grad=True)
    batched = _roll(model, draws, gens, grad_steps=draws.selected)
    assert torch.equal(traj.next_latents, batched.next_latents) and torch.equal(traj.log_probs, batched.log_probs)
    assert calls == [(1, True)] * 3 + [(1, True)] * 3 + [(3, False)] * 2  # batch-1 grad forwards at trained steps
    assert [(r.t, r.row, r.grad) for r in records] == [
        (0, 0, True), (0, 1, True), (0, 2, True), (0, None, False),
        (1, 0, True), (1, 1, True), (1, 2, True), (1, None, False), (2, None, False), (3, None, False)]
    for r in records[:3]:
        assert r.latents.shape == (1, 3, 4) and r.sde.log_prob.shape == (1,) and r.sde.log_prob.requires_grad
        assert torch.equal(r.next_latents[0], traj.next_latents[r.row, 0])
        assert torch.equal(r.sde.log_prob.detach()[0], traj.log_probs[r.row, 0])
    # a row that does not train at the step shares one no-grad forward with the others like it
    calls.clear()
    mask = draws.selected.clone()
    mask[1] = False
    _roll(counted, draws, gens, grad_steps=mask, per_sample_grad=True)
    assert calls[:3] == [(1, False), (1, True), (1, True)]


def test_trained_rows_of_loops_stepped_together_go_to_train_rows_at_once():
    """``rollout_together`` with ``train_rows`` (Reweight at pipeline stages): every trained row of a step, of all
    the loops, in one call, whose records are the ones the loop would hand over; every loop ends on its own
    trajectory (DanceGRPO selection: the loops train different steps)."""
    model, sigmas = RowWise(), get_sigmas("sd3", 4)
    sde = SDEParams.from_sigmas("flow_grpo", 0.7, sigmas)
    batches = [[0, 1], [2], [3, 4]]
    draws = {tuple(g): _inputs(g, method="dance_grpo", fraction=0.5) for g in batches}

    def loop(gens, on_step=None):
        d = draws[tuple(gens)]
        return RolloutLoop(d.init_latents, sigmas, Conditioning(encoder_hidden_states=torch.zeros(len(gens), 1, 1)),
                           sde=sde, selected=d.selected, sde_steps=d.sde_steps, noise_seeds=d.noise_seeds,
                           prompt_ids=torch.zeros(len(gens)), generation_ids=torch.tensor(gens),
                           grad_steps=d.selected, on_step=on_step, per_sample_grad=True)

    alone = {}
    for gens in batches:
        records = []
        single = loop(gens, records.append)
        while not single.done:
            single.step(model)
        alone[tuple(gens)] = (single.trajectory(), [r for r in records if r.grad])
    calls, handed = [], []

    def train_rows(rows):
        calls.append([(row.loop, row.row) for row in rows])
        out = []
        for row in rows:
            with torch.enable_grad():
                record = row.record(model(row.latents, row.sigma, row.conditioning))
            handed.append((row.loop, record))
            out.append(model(row.latents, row.sigma, row.conditioning).detach())
        return out

    loops = [loop(gens) for gens in batches]
    rollout_together(loops, model, lambda requests: [model(*r) for r in requests], train_rows=train_rows)
    expected = [sorted((i, r) for i, g in enumerate(batches) for r in range(len(g))
                       if bool(draws[tuple(g)].selected[r, t])) for t in range(4)]
    assert calls == [rows for rows in expected if rows] and sum(map(len, calls)) == 5  # one trained step each
    assert len(calls) > 1  # the loops train different steps
    for i, gens in enumerate(batches):
        traj, records = alone[tuple(gens)]
        mine = loops[i].trajectory()
        assert torch.equal(mine.next_latents, traj.next_latents) and torch.equal(mine.log_probs, traj.log_probs)
        ours = [record for index, record in handed if index == i]
        assert [(r.t, r.row) for r in ours] == [(r.t, r.row) for r in records]
        for a, b in zip(ours, records):
            assert a.sde.log_prob.requires_grad and torch.equal(a.sde.log_prob, b.sde.log_prob)
            assert torch.equal(a.next_latents, b.next_latents) and torch.equal(a.sde.mean, b.sde.mean)


def test_micro_batches_draw_the_same_trajectories():
    model = RowWise()
    whole = _roll(model, _inputs([0, 1, 2, 3]), [0, 1, 2, 3])
    part = _roll(model, _inputs([2, 3]), [2, 3])
    assert torch.equal(whole.next_latents[2:], part.next_latents)
    assert torch.equal(whole.log_probs[2:], part.log_probs)


def test_ode_outside_the_sde_window():
    model, gens = RowWise(), [0, 1]
    draws = _inputs(gens, method="sde_window", fraction=1.0, window_size=1, window_range=(1, 3))
    traj = _roll(model, draws, gens)
    for i in range(2):
        for t in range(4):
            if bool(draws.sde_steps[i, t]):
                assert float(traj.log_probs[i, t]) != 0.0
                continue
            assert float(traj.log_probs[i, t]) == 0.0
            x, sigma = traj.latents[i:i + 1, t], traj.sigmas[i:i + 1]
            v = model(x, sigma[:, t], None)
            assert torch.allclose(traj.next_latents[i, t], (x + v * (sigma[:, t + 1] - sigma[:, t]))[0])


def test_rollout_rejects_selected_ode_steps():
    draws = _inputs([0], method="sde_window", fraction=1.0, window_size=1, window_range=(1, 2))
    bad = draws.selected.clone()
    bad[0, 0] = True
    with pytest.raises(ValueError, match="selected step must be an SDE step"):
        rollout(RowWise(), draws.init_latents, get_sigmas("sd3", 4), Conditioning(torch.zeros(1, 1, 1)),
                sde=SDEParams.from_sigmas("flow_grpo", 0.7, get_sigmas("sd3", 4)), selected=bad,
                sde_steps=draws.sde_steps, noise_seeds=draws.noise_seeds, prompt_ids=torch.zeros(1),
                generation_ids=torch.zeros(1))


class Recorder(torch.nn.Module):
    """Stand-in policy that records its keyword inputs and returns a fixed function of them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.calls = []

    def forward(self, **kw):
        self.calls.append(kw)
        states = kw["encoder_hidden_states"].mean(dim=(1, 2)).view(-1, *([1] * (kw["hidden_states"].ndim - 1)))
        return kw["hidden_states"] * self.weight + states


def test_flux_packing_ids_and_guidance():
    latents = torch.randn(2, 4, 6, 8)
    packed = pack_flux_latents(latents)
    assert packed.shape == (2, 12, 16)
    assert torch.equal(packed[1, 5].view(4, 2, 2), latents[1, :, 2:4, 2:4])
    assert torch.equal(unpack_flux_latents(packed, 6, 8), latents)
    assert flux_image_ids(6, 8)[5].tolist() == [0.0, 1.0, 1.0]
    policy = Recorder()
    velocity = FluxVelocity(policy, latent_height=6, latent_width=8)
    cond = Conditioning(encoder_hidden_states=torch.ones(2, 3, 5), pooled_projections=torch.zeros(2, 7),
                        guidance=torch.full((2,), 3.5))
    out = velocity(packed, torch.tensor([1.0, 0.25]), cond)
    call = policy.calls[-1]
    assert out.dtype == torch.float32 and torch.equal(out, packed + 1.0)
    assert call["timestep"].tolist() == [1.0, 0.25]  # sigma: FluxPipeline hands t/1000 to the transformer
    assert call["guidance"].tolist() == [3.5, 3.5] and call["txt_ids"].shape == (3, 3)
    dance = FluxVelocity(policy, latent_height=6, latent_width=8, sigma_kind="dance")
    dance(packed, torch.tensor([0.9876, 0.5]), cond)
    assert torch.allclose(policy.calls[-1]["timestep"], torch.tensor([0.987, 0.5]))  # int(sigma * 1000) / 1000


def test_wan_cfg_runs_both_branches_in_one_batch():
    policy = Recorder()
    velocity = WanVelocity(policy, cfg_scale=5.0)
    latents = torch.randn(2, 4, 1, 2, 2)
    cond = Conditioning(encoder_hidden_states=torch.full((2, 3, 5), 2.0),
                        negative_encoder_hidden_states=torch.full((2, 3, 5), 0.5))
    out = velocity(latents, torch.tensor([0.5, 0.25]), cond)
    assert len(policy.calls) == 1 and policy.calls[0]["hidden_states"].shape[0] == 4
    assert policy.calls[0]["timestep"].tolist() == [500.0, 250.0, 500.0, 250.0]
    uncond, cond_out = latents + 0.5, latents + 2.0
    assert torch.allclose(out, uncond + 5.0 * (cond_out - uncond))
    with pytest.raises(ValueError, match="negative_encoder_hidden_states"):
        velocity(latents, torch.tensor([0.5, 0.25]), Conditioning(encoder_hidden_states=torch.ones(2, 3, 5)))
    with pytest.raises(ValueError, match="has none"):
        with velocity.reference():
            pass
