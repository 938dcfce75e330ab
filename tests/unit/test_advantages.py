import numpy as np
import pytest
import torch

from leangrpo_mcore.rl.advantages import (
    ADVANTAGES,
    advantage_affine,
    available_advantages,
    clamp_would_fire,
    compute_advantages,
    register_advantage,
    weighted_sum,
)

# Three groups with ids deliberately interleaved and unsorted.
REWARDS = np.array([0.3, 2.0, -1.0, 0.7, 5.0, 1.5, 0.1, 4.0, -0.5, 3.0])
IDS = np.array([7, 2, 7, 2, 11, 7, 2, 11, 7, 11])


def _numpy_reference(rewards, ids, *, ddof, eps, global_std=False):
    out = np.empty_like(rewards)
    for g in np.unique(ids):
        sel = ids == g
        std = np.std(rewards, ddof=ddof) if global_std else np.std(rewards[sel], ddof=ddof)
        out[sel] = (rewards[sel] - rewards[sel].mean()) / (std + eps)
    return out


def _adv(kind, rewards=REWARDS, ids=IDS, **kw):
    kw.setdefault("adv_clip_max", None)
    return compute_advantages(kind, torch.tensor(rewards, dtype=torch.float32), torch.tensor(ids), **kw)


@pytest.mark.parametrize(
    "kind,ddof,eps,global_std",
    [
        ("flow_grpo", 0, 1e-4, False),
        ("flow_grpo", 0, 1e-4, True),
        ("dance_grpo", 1, 1e-8, False),
        ("dance_grpo", 1, 1e-8, True),
    ],
)
def test_matches_numpy(kind, ddof, eps, global_std):
    rewards32 = REWARDS.astype(np.float32).astype(np.float64)
    expected = _numpy_reference(rewards32, IDS, ddof=ddof, eps=eps, global_std=global_std)
    adv = _adv(kind, global_std=global_std)
    assert adv.dtype == torch.float32 and adv.shape == (10,)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_ddof_and_eps_are_distinct():
    flow = _adv("flow_grpo").numpy()
    dance = _adv("dance_grpo").numpy()
    # Group 11 holds rewards 5, 4, 3: std 1 with ddof 1, sqrt(2/3) with ddof 0; the eps differ too.
    sel = (IDS == 11) & (REWARDS != 4.0)
    np.testing.assert_allclose(flow[sel] / dance[sel], (1.0 + 1e-8) / (np.sqrt(2 / 3) + 1e-4), rtol=1e-6)
    # Equal rewards in a group: std 0, the eps keeps the advantage 0 (not NaN).
    zero = _adv("flow_grpo", rewards=np.array([1.0, 1.0, 2.0, 3.0]), ids=np.array([0, 0, 1, 1]))
    assert zero[:2].tolist() == [0.0, 0.0]
    np.testing.assert_allclose(zero[2:].numpy(), [-0.5 / (0.5 + 1e-4), 0.5 / (0.5 + 1e-4)], rtol=1e-6)


def test_group_order_does_not_matter():
    perm = np.random.default_rng(0).permutation(len(REWARDS))
    base = _adv("flow_grpo").numpy()
    permuted = _adv("flow_grpo", rewards=REWARDS[perm], ids=IDS[perm] * 3 - 100).numpy()
    np.testing.assert_allclose(permuted, base[perm], rtol=1e-6)


def test_clamp():
    rewards = np.array([0.0] * 9 + [100.0])
    ids = np.zeros(10, dtype=np.int64)
    raw = _adv("flow_grpo", rewards=rewards, ids=ids)
    assert raw.max().item() == pytest.approx(3.0, rel=1e-4)  # (100-10)/30
    clamped = _adv("flow_grpo", rewards=rewards, ids=ids, adv_clip_max=2.5)
    assert clamped.max().item() == 2.5
    assert torch.equal(clamped[:9], raw[:9])
    assert clamp_would_fire(raw, 2.5) and not clamp_would_fire(raw, 3.5) and not clamp_would_fire(raw, None)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo"])
@pytest.mark.parametrize("global_std", [False, True])
def test_affine_reproduces_unclamped(kind, global_std):
    rewards = torch.tensor(REWARDS, dtype=torch.float32)
    alpha, gamma = advantage_affine(kind, rewards, torch.tensor(IDS), global_std=global_std)
    adv = compute_advantages(kind, rewards, torch.tensor(IDS), adv_clip_max=None, global_std=global_std)
    np.testing.assert_allclose((alpha * rewards.double() + gamma).numpy(), adv.numpy(), rtol=1e-6, atol=1e-6)
    if global_std:
        assert torch.unique(alpha).numel() == 1
    else:
        for g in np.unique(IDS):
            assert torch.unique(alpha[torch.tensor(IDS == g)]).numel() == 1


def test_errors():
    with pytest.raises(ValueError, match="unknown advantage kind 'grpo'; valid: dance_grpo, flow_grpo"):
        _adv("grpo")
    with pytest.raises(ValueError, match="group id 5 has 1"):
        _adv("dance_grpo", rewards=np.array([1.0, 2.0, 3.0]), ids=np.array([0, 0, 5]))
    with pytest.raises(ValueError, match="non-finite"):
        _adv("flow_grpo", rewards=np.array([1.0, np.nan]), ids=np.array([0, 0]))
    with pytest.raises(ValueError, match="integer"):
        compute_advantages("flow_grpo", torch.ones(2), torch.zeros(2), adv_clip_max=5.0)
    with pytest.raises(ValueError, match="shaped like rewards"):
        compute_advantages("flow_grpo", torch.ones(2), torch.zeros(3, dtype=torch.long), adv_clip_max=5.0)
    with pytest.raises(ValueError, match="adv_clip_max"):
        _adv("flow_grpo", adv_clip_max=0.0)


def test_registry_extension():
    @register_advantage("_test_centered")
    def centered(rewards, group_ids, *, eps=0.0, global_std=False):
        return rewards - rewards.mean()

    try:
        assert "_test_centered" in available_advantages()
        adv = _adv("_test_centered", rewards=np.array([1.0, 3.0]), ids=np.array([0, 0]), adv_clip_max=0.5)
        assert adv.tolist() == [-0.5, 0.5]
        with pytest.raises(ValueError, match="affine"):
            advantage_affine("_test_centered", torch.ones(2), torch.zeros(2, dtype=torch.long))
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("_test_centered")(centered)
    finally:
        ADVANTAGES.pop("_test_centered")


# Two components of very different scales on the groups above, and their weights (one negative).
COMPONENTS = np.stack([REWARDS, 1e-2 * np.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0])], axis=1)
WEIGHTS = (1.0, -0.5)


def _multi_reference(components, ids, weights, *, ddof, eps, global_std, clip):
    """float64: Σ_k w_k (r_k − group mean_k) / (std_k + eps), std with ``ddof`` (of all N with global std), clamped."""
    total = np.zeros(len(ids))
    for k, weight in enumerate(weights):
        total += weight * _numpy_reference(components[:, k], ids, ddof=ddof, eps=eps, global_std=global_std)
    return total if clip is None else np.clip(total, -clip, clip)


@pytest.mark.parametrize(
    "kind,ddof,eps,global_std",
    [
        ("flow_grpo", 0, 1e-4, False),
        ("flow_grpo", 0, 1e-4, True),
        ("dance_grpo", 1, 1e-8, False),
        ("dance_grpo", 1, 1e-8, True),
    ],
)
@pytest.mark.parametrize("clip", [None, 0.4])
def test_component_advantages_match_numpy(kind, ddof, eps, global_std, clip):
    components32 = COMPONENTS.astype(np.float32)
    expected = _multi_reference(components32.astype(np.float64), IDS, WEIGHTS, ddof=ddof, eps=eps,
                                global_std=global_std, clip=clip)
    adv = compute_advantages(kind, torch.tensor(components32), torch.tensor(IDS), adv_clip_max=clip,
                             global_std=global_std, weights=WEIGHTS)
    assert adv.dtype == torch.float32 and adv.shape == (10,)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-6, atol=1e-6)
    if clip is not None:  # the clamp fires, and after the sum: clamping each component first would differ
        unclamped = _multi_reference(COMPONENTS, IDS, WEIGHTS, ddof=ddof, eps=eps, global_std=global_std, clip=None)
        assert np.abs(unclamped).max() > clip
        per_component = sum(w * np.clip(_numpy_reference(COMPONENTS[:, k], IDS, ddof=ddof, eps=eps,
                                                         global_std=global_std), -clip, clip)
                            for k, w in enumerate(WEIGHTS))
        assert np.abs(per_component - expected).max() > 1e-2


def test_component_advantages_differ_from_the_advantage_of_the_weighted_sum():
    components = torch.tensor(COMPONENTS, dtype=torch.float32)
    per_component = compute_advantages("flow_grpo", components, torch.tensor(IDS), adv_clip_max=None, weights=WEIGHTS)
    summed = compute_advantages("flow_grpo", weighted_sum(components, WEIGHTS), torch.tensor(IDS), adv_clip_max=None)
    assert (per_component - summed).abs().max() > 0.1
    one = compute_advantages("flow_grpo", components[:, :1], torch.tensor(IDS), adv_clip_max=None, weights=(1.0,))
    assert torch.equal(one, compute_advantages("flow_grpo", components[:, 0], torch.tensor(IDS), adv_clip_max=None))


def test_weighted_sum_and_component_errors():
    values = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
    assert weighted_sum(values, (0.5, 2.0)).tolist() == [4.5, -6.5]
    ids = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"an \(N, 2\) tensor, got shape \(2,\)"):
        compute_advantages("flow_grpo", values[:, 0], ids, adv_clip_max=None, weights=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"an \(N, 3\) tensor, got shape \(2, 2\)"):
        compute_advantages("flow_grpo", values, ids, adv_clip_max=None, weights=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="finite"):
        compute_advantages("flow_grpo", values, ids, adv_clip_max=None, weights=(1.0, float("nan")))
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages("flow_grpo", torch.tensor([[1.0, 2.0], [3.0, float("inf")]]), ids, adv_clip_max=None,
                           weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="2 weights for values of shape"):
        weighted_sum(torch.ones(3), (1.0, 1.0))
