"""The planner counts the passes the step engine runs: MixGRPO-Flash's compressed tails (T' forwards per rollout, as
the window moves) and, with K updates per rollout, each sample trained once by its block's schedule; against hand
counts written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from leangrpo_mcore.config import load_config
from leangrpo_mcore.planner.cost_model import estimate
from leangrpo_mcore.planner.flops import step_flops_for_config
from leangrpo_mcore.planner.layout import workload_from_config
from leangrpo_mcore.planner.passes import step_passes, sync_count
from leangrpo_mcore.planner.workload import Hardware, Layout, sample_shape

ROOT = Path(__file__).resolve().parents[2]
MIX = str(ROOT / "yaml_configs" / "flux_dev" / "mixgrpo_flash.yaml")
BENCH = str(ROOT / "yaml_configs" / "bench" / "flux_flowgrpo.yaml")


def _mixgrpo_flash_forwards(start: int) -> int:
    """MixGRPO-Flash's rollout length at a window of 4 starting at ``start`` of 25 steps (ratio 0.4): the steps up to
    the window's end, then P − 1 steps for P = int((25 − last)·0.4) points (at least one step)."""
    end, last = start + 4, start + 3
    tail = max(int((25 - last) * 0.4) - 1, 1)
    return 25 if tail >= 25 - end else end + tail


def test_mixgrpo_flash_forwards_are_the_compressed_rollouts():
    config = load_config(MIX)
    work = workload_from_config(config)
    hand = [_mixgrpo_flash_forwards(k) for k in range(20)]  # the progressive window's 20 starts, 20 steps each
    assert hand[0] == 4 + 7 and hand[-1] == 23 + 1
    assert work.rollout_steps == pytest.approx(sum(hand) / 20)
    assert step_passes(work, "native") == pytest.approx((sum(hand) / 20 + 4, 4))
    assert step_passes(work, "retain") == step_passes(work, "reweight") == pytest.approx((sum(hand) / 20, 4))
    full = workload_from_config(load_config(MIX, ["sampler.ode_steps_after_window=0"]))
    assert full.forwards_per_rollout == 25 and step_passes(full, "retain") == (25, 4)
    hw, layout = Hardware(nodes=1, gpus_per_node=4), Layout(tp=1, dp_shard=4, dp_replicate=1)
    ratio = estimate(work, hw, layout, "retain", False).time["rollout"] / \
        estimate(full, hw, layout, "retain", False).time["rollout"]
    assert ratio == pytest.approx(sum(hand) / 20 / 25)
    # the FLOP count of a step at a given window start runs that start's forwards
    at_first = step_flops_for_config(config, "retain", window_start=0)
    assert at_first.counts["nograd"] == (11 - 4) * 24 and at_first.counts["rollout_grad"] == 4 * 24


@pytest.mark.parametrize("kl", [False, True])
def test_two_updates_train_each_sample_once(kl):
    """K = 2 on two ranks (shared layout: both prompts on every rank, two generations each): the first prompt by the
    schedule, the second by Native after the first optimizer step."""
    overrides = ["grpo.updates_per_rollout=2", "grpo.prompts_per_step=2"]
    if kl:
        overrides += ["grpo.kl_beta=0.01", "model.lora.rank=4"]
    work = workload_from_config(load_config(BENCH, overrides))
    t, s = 6, 5
    ref = s if kl else 0
    native = (t + s + ref, s)
    hand = {"native": native,
            "retain": ((t + ref + native[0]) / 2, s),  # half the samples Retain's, half Native's
            "reweight": ((t + ref + native[0]) / 2, (s * (2 if kl else 1) + s) / 2)}  # Reweight's KL backward apart
    for schedule, counts in hand.items():
        assert step_passes(work, schedule) == pytest.approx(counts)
    layout = Layout(tp=1, dp_shard=2, dp_replicate=1)
    shape = sample_shape(work, layout)
    assert (shape.samples, shape.groups_per_rank, shape.micro_batches) == (4, 2, 4)
    # Reweight reduces its own group once, the later block once; Retain once per update; Native every backward
    assert sync_count(work, shape, "reweight") == 2 and sync_count(work, shape, "retain") == 2
    assert sync_count(work, shape, "native") == 4 * s
    est = estimate(work, Hardware(nodes=1, gpus_per_node=2), layout, "retain", False)
    one = estimate(work, Hardware(nodes=1, gpus_per_node=2), layout, "native", False)
    # 4 samples a rank: Retain backpropagates each once (not once per update), recomputes half of them
    assert est.time["backward"] == pytest.approx(one.time["backward"])
    assert est.time["recompute"] == pytest.approx(one.time["recompute"] / 2)
