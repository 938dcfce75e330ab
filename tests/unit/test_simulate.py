"""The fake-tensor step simulator: the dispatch mode's ledger, and the reductions of a full-size simulation."""

import dataclasses

import pytest
import torch

from leangrpo_mcore.config import load_config
from leangrpo_mcore.planner.sim_mode import FAKE_FLOAT, SimulationMode, is_fake
from leangrpo_mcore.planner.simulate import FIRST_BACKWARD, selected_steps, simulate, simulate_step, with_steps

BIG = (1 << 20) + 1  # one element more than stays real


def test_large_tensors_are_fake_small_ones_real_and_every_storage_is_counted():
    with SimulationMode() as sim:
        small = torch.arange(10, dtype=torch.float32)
        a = torch.zeros(BIG)
        b = torch.ones(BIG) * 2.0
        assert not is_fake(small) and float(small.sum()) == 45.0
        assert is_fake(a) and is_fake(b)
        level = sim.ledger.total
        assert level >= 2 * BIG * 4 + 40
        del a
        assert sim.ledger.total == level - BIG * 4
        assert sim.ledger.peak >= level
    at_peak = sim.ledger.at_peak()
    assert sum(at_peak.values()) == sim.ledger.peak


def test_reading_a_fake_value_is_counted_and_masks_stay_exact():
    with SimulationMode() as sim:
        x = torch.randn(BIG)
        assert float(x.sum()) == FAKE_FLOAT and sim.fake_reads == 1
        mask = torch.zeros(BIG, dtype=torch.bool)  # large: fake, but a small real mask indexes exactly
        keep = torch.tensor([True, False, True, True])
        rows = torch.randn(4, BIG // 4 + 1)
        assert is_fake(mask) and tuple(rows[keep].shape) == (3, BIG // 4 + 1)


def test_all_fake_makes_even_small_tensors_fake():
    with SimulationMode() as sim:
        with sim.all_fake():
            w = torch.empty(4)
        assert is_fake(w)


def test_steps_are_reduced_and_retained_graphs_scaled():
    cfg = load_config("yaml_configs/tiny/flux.yaml", ["sampler.num_steps=16", "grpo.timestep_fraction=1.0"])
    small, graphs = with_steps(cfg)
    assert (small.sampler.num_steps, selected_steps(small), graphs) == (2, 2, 8.0)
    dance = load_config("yaml_configs/tiny/flux.yaml", ["sampler.num_steps=16", "grpo.timestep_selection=dance_grpo",
                                                        "grpo.timestep_fraction=0.5"])
    small, graphs = with_steps(dance)
    assert (small.sampler.num_steps, selected_steps(small), graphs) == (2, 1, 7.0)
    three = load_config("yaml_configs/tiny/flux.yaml")  # T=3, |S|=2: nothing to reduce (2 trained + 1 untrained)
    assert with_steps(three) == (three, 1.0)
    half = load_config("yaml_configs/tiny/flux.yaml", ["sampler.num_steps=16", "grpo.timestep_fraction=0.5"])
    small, graphs = with_steps(half)  # 2 trained steps and the untrained one after them
    assert (small.sampler.num_steps, selected_steps(small), graphs) == (3, 2, 4.0)
    short = load_config("yaml_configs/tiny/flux.yaml", ["sampler.num_steps=2"])
    assert with_steps(short) == (short, 1.0)


WAN = ["model.arch={num_layers: 6, num_attention_heads: 4, attention_head_dim: 24, ffn_dim: 256}",
       "sampler.height=64", "sampler.width=64", "sampler.frames=5", "sampler.num_steps=4",
       "grpo.timestep_fraction=1.0", "grpo.group_size=2", "grpo.prompts_per_step=1", "schedule.name=retain"]


def test_reduced_simulation_matches_the_direct_one():
    """Blocks extrapolated from 3 and 4 to 6, denoising steps from 2 to 4: Retain's peak (graphs of every step)
    against the direct simulation of the config as written."""
    cfg = load_config("yaml_configs/tiny/wan.yaml", WAN)
    reduced = simulate(cfg, 2)
    direct = simulate_step(cfg, 2)
    assert len(reduced.notes) == 2  # both reductions happened
    assert reduced.peak_bytes == pytest.approx(direct.peak_bytes, rel=0.02)
    assert reduced.breakdown["retained_graphs"] == pytest.approx(direct.breakdown["retained_graphs"], rel=0.02)
    assert direct.breakdown["retained_graphs"] > 0.5 * direct.step_peak_bytes
    # the update's first backward: every other graph still kept, the gradients being made
    first_reduced, first_direct = (sum(sim.regions[FIRST_BACKWARD].values()) for sim in (reduced, direct))
    assert first_reduced == pytest.approx(first_direct, rel=0.02)
    assert direct.regions[FIRST_BACKWARD]["retained_graphs"] > 0.5 * direct.regions["rollout"]["retained_graphs"]
