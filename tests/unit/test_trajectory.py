import dataclasses

import pytest
import torch

from leangrpo_mcore.diffusion import Conditioning, Trajectory

B, T, LATENT = 5, 4, (3, 2, 2)


def _conditioning(batch=B, with_optional=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Conditioning(
        encoder_hidden_states=torch.randn(batch, 7, 6, generator=gen).to(torch.bfloat16),
        pooled_projections=torch.randn(batch, 4, generator=gen) if with_optional else None,
        negative_encoder_hidden_states=torch.randn(batch, 7, 6, generator=gen) if with_optional else None,
        guidance=torch.full((batch,), 3.5) if with_optional else None,
    )


def _trajectory(batch=B, seed=0, **overrides):
    gen = torch.Generator().manual_seed(seed)
    chain = torch.randn(batch, T + 1, *LATENT, generator=gen)
    fields = dict(
        latents=chain[:, :-1].clone(),
        next_latents=chain[:, 1:].clone(),
        log_probs=torch.randn(batch, T, generator=gen),
        sigmas=torch.linspace(1, 0, T + 1).expand(batch, -1).clone(),
        selected=torch.rand(batch, T, generator=gen) < 0.5,
        prompt_ids=torch.arange(batch) // 2 + 100 * seed,
        generation_ids=torch.arange(batch) % 2,
        conditioning=_conditioning(batch, seed=seed),
        final_latents=chain[:, -1].clone(),
    )
    fields.update(overrides)
    return Trajectory(**fields)


def _assert_same(a, b):
    for f in dataclasses.fields(Trajectory):
        if f.name == "conditioning":
            for g in dataclasses.fields(Conditioning):
                x, y = getattr(a.conditioning, g.name), getattr(b.conditioning, g.name)
                assert (x is None and y is None) or torch.equal(x, y), g.name
        else:
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert (x is None and y is None) or torch.equal(x, y), f.name


def test_properties_and_selected_steps():
    selected = torch.tensor([[True, False, True, False]] + [[False, False, False, True]] * (B - 1))
    traj = _trajectory(selected=selected)
    assert (traj.num_samples, traj.num_steps, tuple(traj.latent_shape)) == (B, T, LATENT)
    assert traj.selected_steps(0) == [0, 2]
    assert traj.selected_steps(3) == [3]
    with pytest.raises(ValueError, match="out of range"):
        traj.selected_steps(B)


def test_select_picks_rows_in_order():
    traj = _trajectory()
    sub = traj.select([3, 1])
    assert sub.num_samples == 2
    assert torch.equal(sub.latents[0], traj.latents[3]) and torch.equal(sub.latents[1], traj.latents[1])
    assert sub.prompt_ids.tolist() == [traj.prompt_ids[3].item(), traj.prompt_ids[1].item()]
    assert torch.equal(sub.conditioning.encoder_hidden_states[0], traj.conditioning.encoder_hidden_states[3])
    assert torch.equal(sub.conditioning.guidance, torch.full((2,), 3.5))
    assert sub.conditioning.encoder_hidden_states.dtype == torch.bfloat16
    _assert_same(traj.select(torch.tensor([3, 1])), sub)


def test_split_cat_round_trip():
    traj = _trajectory()
    pieces = traj.split([2, 0, 3])
    assert [p.num_samples for p in pieces] == [2, 0, 3]
    assert torch.equal(pieces[2].final_latents, traj.final_latents[2:])
    _assert_same(Trajectory.cat(pieces), traj)
    # cat of trajectories from different rollouts, then select back the second one
    other = _trajectory(batch=3, seed=1)
    both = Trajectory.cat([traj, other])
    assert both.num_samples == B + 3
    _assert_same(both.select(range(B, B + 3)), other)
    permuted = traj.select([4, 0, 2, 1, 3])
    _assert_same(permuted.select([1, 3, 2, 4, 0]), traj)


def test_conditioning_without_optional_fields():
    cond = _conditioning(with_optional=False)
    sub = cond.select([0, 2])
    assert sub.pooled_projections is None and sub.guidance is None
    assert sub.num_samples == 2
    merged = Conditioning.cat([sub, cond])
    assert merged.num_samples == 2 + B
    assert torch.equal(merged.encoder_hidden_states[2:], cond.encoder_hidden_states)
    moved = cond.to("cpu")
    assert torch.equal(moved.encoder_hidden_states, cond.encoder_hidden_states)
    with pytest.raises(ValueError, match="None in some items only"):
        Conditioning.cat([cond, _conditioning()])
    longer = Conditioning(encoder_hidden_states=torch.zeros(1, 9, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shapes differ beyond the batch"):
        Conditioning.cat([cond, longer])


def test_to_device_keeps_values():
    traj = _trajectory()
    _assert_same(traj.to("cpu"), traj)


@pytest.mark.parametrize(
    "override,message",
    [
        ({"latents": torch.zeros(B, T, *LATENT, dtype=torch.bfloat16)}, "trajectory.latents must be torch.float32"),
        ({"next_latents": torch.zeros(B, T + 1, *LATENT)}, "trajectory.next_latents must have shape"),
        ({"log_probs": torch.zeros(B, T + 1)}, r"trajectory.log_probs must have shape \(5, 4\)"),
        ({"sigmas": torch.zeros(B, T)}, r"trajectory.sigmas must have shape \(5, 5\)"),
        ({"selected": torch.zeros(B, T)}, "trajectory.selected must be torch.bool"),
        ({"prompt_ids": torch.zeros(B, dtype=torch.int32)}, "trajectory.prompt_ids must be torch.int64"),
        ({"generation_ids": torch.zeros(B + 1, dtype=torch.long)}, "trajectory.generation_ids must have shape"),
        ({"final_latents": torch.zeros(B, 3, 2, 3)}, r"trajectory.final_latents must have shape \(5, 3, 2, 2\)"),
        ({"conditioning": _conditioning(batch=B - 1)}, "conditioning has 4 samples, trajectory has 5"),
        ({"latents": torch.zeros(B, T)}, "latents must be"),
    ],
)
def test_validate_errors(override, message):
    with pytest.raises(ValueError, match=message):
        _trajectory(**override)


def test_validate_after_mutation_and_bad_indices():
    traj = _trajectory()
    traj.log_probs = traj.log_probs.double()
    with pytest.raises(ValueError, match="log_probs must be torch.float32"):
        traj.validate()
    traj = _trajectory()
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 5\)"):
        traj.select([0, 5])
    with pytest.raises(ValueError, match="1-D sequence of ints"):
        traj.select(torch.ones(B, dtype=torch.bool))
    with pytest.raises(ValueError, match="sum to 5"):
        traj.split([2, 2])
    with pytest.raises(ValueError, match="does not match"):
        Trajectory.cat([traj, _trajectory(latents=torch.zeros(B, T, 3, 2, 3), next_latents=torch.zeros(B, T, 3, 2, 3),
                                           final_latents=torch.zeros(B, 3, 2, 3))])
    with pytest.raises(ValueError, match="pooled_projections must have 2 dims"):
        Conditioning(encoder_hidden_states=torch.zeros(2, 3, 4), pooled_projections=torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match="encoder_hidden_states must be"):
        Conditioning(encoder_hidden_states=torch.zeros(2, 3))


def test_kept_sde_means_travel_with_the_rows():
    means = torch.randn(B, T, *LATENT, generator=torch.Generator().manual_seed(5))
    traj = _trajectory(means=means)
    _assert_same(traj.select([3, 1]), _trajectory(means=means).select([3, 1]))
    assert torch.equal(traj.select([3, 1]).means, means[[3, 1]])
    assert torch.equal(Trajectory.cat(traj.split([2, 3])).means, means)
    with pytest.raises(ValueError, match="shape"):
        _trajectory(means=means[:, :2])
    with pytest.raises(ValueError, match="keep their SDE means and some do not"):
        Trajectory.cat([traj, _trajectory()])
