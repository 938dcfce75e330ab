"""Selected steps and seeds: drawn before the rollout, from train.seed and sample names only."""

from __future__ import annotations

import pytest
import torch

from leangrpo_mcore.diffusion.seeding import derive_seed, initial_noise, sde_noise_seeds
from leangrpo_mcore.diffusion.selection import check_selection, num_selected, select_steps


def _select(method, slots, gens, **kw):
    args = dict(num_steps=6, fraction=0.99, base_seed=0, step=3)
    args.update(kw)
    return select_steps(method, prompt_slots=slots, generation_ids=gens, **args)


def test_flow_grpo_selects_the_first_steps():
    sel = _select("flow_grpo", [0, 1], [0, 3])
    assert sel.selected.tolist() == [[True] * 5 + [False]] * 2  # FLUX T=6, fraction 0.99 -> 5
    assert bool(sel.sde.all())
    assert num_selected("flow_grpo", 10, 0.99) == 9  # SD3 T=10 -> 9


def test_sde_window_is_shared_by_the_group_with_ode_elsewhere():
    slots, gens = [0, 0, 0, 1, 1], [0, 1, 2, 0, 1]
    sel = _select("sde_window", slots, gens, window_size=2, window_range=(0, 4), fraction=1.0)
    starts = [int(row.nonzero()[0]) for row in sel.selected]
    assert starts[0] == starts[1] == starts[2] and starts[3] == starts[4]
    assert all(0 <= s < 4 for s in starts)
    assert sel.selected.sum(1).tolist() == [2] * 5
    assert torch.equal(sel.selected, sel.sde)  # SDE exactly on the trained window
    other = {int(_select("sde_window", [p], [0], window_size=2, window_range=(0, 4), fraction=1.0)
                 .selected[0].nonzero()[0]) for p in range(12)}
    assert len(other) > 1  # the start really is drawn per prompt


def test_dance_grpo_random_subset_per_sample():
    sel = _select("dance_grpo", [0] * 6, list(range(6)), fraction=0.6)
    assert sel.selected.sum(1).tolist() == [3] * 6  # int((6 - 1) * 0.6)
    assert not bool(sel.selected[:, -1].any())  # the last step (sigma' = 0) is never a candidate
    assert len({tuple(row.tolist()) for row in sel.selected}) > 1


def test_draws_depend_on_the_sample_name_only():
    alone = _select("dance_grpo", [2], [5], fraction=0.6)
    batched = _select("dance_grpo", [0, 2, 1], [1, 5, 5], fraction=0.6)
    assert torch.equal(alone.selected[0], batched.selected[1])
    a = initial_noise(7, 4, [2], [5], (3, 4))
    b = initial_noise(7, 4, [0, 2], [1, 5], (3, 4))
    assert torch.equal(a[0], b[1]) and not torch.equal(b[0], b[1])
    shared = initial_noise(7, 4, [2, 2], [0, 5], (3, 4), same_latent=True)
    assert torch.equal(shared[0], shared[1])
    seeds = sde_noise_seeds(7, 4, [2, 2], [0, 5], num_steps=3)
    assert seeds.shape == (2, 3) and len(set(seeds.flatten().tolist())) == 6  # per generation and step
    assert derive_seed(7, "sde_noise", 4, 2, 5, 1) == int(seeds[1, 1])
    assert derive_seed(7, "sde_noise", 4, 2, 5, 1) != derive_seed(8, "sde_noise", 4, 2, 5, 1)
    assert derive_seed(7, "init_noise", 1) != derive_seed(7, "selection", 1)


@pytest.mark.parametrize("method,kw,match", [
    ("nope", {}, "unknown timestep selection"),
    ("flow_grpo", {"fraction": 0.1}, "selects no step"),
    ("sde_window", {"window_size": 0}, "sde_window_size >= 1"),
    ("sde_window", {"window_size": 3, "window_range": (0, 5)}, "overruns"),
    ("dance_grpo", {"num_steps": 1}, "keeps none"),
])
def test_bad_selection_settings(method, kw, match):
    args = dict(num_steps=6, fraction=0.99, window_size=1, window_range=(0, 2))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        check_selection(method, args["num_steps"], args["fraction"], args["window_size"], args["window_range"])
