"""Planner decisions, multi-node placement, refusals and the config entry points."""

import pytest

from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.arch_specs import load_arch
from leangrpo_mcore.planner.workload import SCHEDULES, GiB, Hardware, Layout, Workload, sample_shape
from leangrpo_mcore.planner.layout import (
    PlanError,
    enumerate_layouts,
    plan,
    plan_for_config,
    predict_memory,
    predict_peak_bytes,
)

TINY_FLUX = "yaml_configs/tiny/flux.yaml"
CLUSTER = Hardware(nodes=4, gpus_per_node=8, gpu_mem_bytes=80 * GiB, gpu_tflops=989, intra_node_gbps=150,
                   inter_node_gbps=25, hbm_gbps=3350)


def _flux(group=8, prompts=4, **kw):
    arch = load_arch("flux-dev")
    return Workload(arch=arch, tokens=arch.tokens(512, 512), num_steps=16, selected_steps=15, group_size=group,
                    prompts_per_step=prompts, **kw)


def test_layouts_keep_tp_cp_and_fsdp_inside_a_node():
    layouts = enumerate_layouts(24, CLUSTER)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}
    for lay in layouts:
        assert 8 % (lay.tp * lay.cp * lay.dp_shard) == 0
        assert lay.tp * lay.cp * lay.dp_shard * lay.dp_replicate == 32
        assert 24 % (lay.tp * lay.cp) == 0  # Ulysses splits the heads of a TP rank over the CP ranks
    assert {(lay.tp, lay.cp) for lay in layouts} == {(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4),
                                                     (4, 1), (4, 2), (8, 1)}
    assert {lay.tp for lay in enumerate_layouts(12, CLUSTER)} == {1, 2, 4}  # TP must divide the 12 heads
    assert {lay.cp for lay in enumerate_layouts(12, CLUSTER, tp=4)} == {1}  # 3 heads per TP rank: no CP
    assert {lay.cp for lay in enumerate_layouts(24, CLUSTER, cp=1)} == {1}
    with pytest.raises(UserError, match="no layout"):
        enumerate_layouts(24, CLUSTER, tp=3)


def test_generation_sharing_shapes():
    work = _flux(group=16, prompts=3)
    assert sample_shape(work, Layout(1, 8, 1)).generations_per_rank == 2  # Q = M / R
    shape = sample_shape(work, Layout(1, 8, 4))  # R = 32 > M: P = 2 worker groups of 16
    assert (shape.worker_groups, shape.ranks_per_group, shape.groups_per_rank) == (2, 16, 2)
    assert shape.idle_fraction == pytest.approx(0.25)  # 3 prompts on 2 x 2 slots
    with pytest.raises(UserError, match="does not split"):
        sample_shape(_flux(group=12), Layout(1, 8, 1))


def test_multi_node_plan_places_groups_inside_nodes():
    result = plan(_flux(group=8, prompts=4), CLUSTER)
    assert result.ok and result.layout.dp_replicate >= 4
    pl = result.placement
    assert pl.tp_groups_intra_node and pl.fsdp_groups_intra_node
    rows = pl.ranks
    assert [r.rank for r in rows] == list(range(32)) and all(r.node == r.rank // 8 for r in rows)
    for r in rows:  # TP peers share a node and make the same generations
        peer = rows[r.rank - r.tp_rank]
        assert peer.node == r.node and peer.generations == r.generations
    # Groups of 8 ranks at TP=1: each prompt group's worker group is exactly one node.
    local = plan(_flux(group=8, prompts=4), CLUSTER, tp=1).placement
    assert local.group_gather_intra_node and local.group_gather_nodes == 1
    assert {r.worker_group for r in local.ranks if r.node == 2} == {2}
    # Every prompt slot's M generations are made exactly once across the data-parallel ranks.
    for slot in range(4):
        made = sorted(g for r in rows if r.tp_rank == 0 and slot in r.prompt_slots for g in r.generations)
        assert made == list(range(8))


def test_group_larger_than_a_node_spans_nodes():
    result = plan(_flux(group=16, prompts=2), CLUSTER, tp=1, dp_shard=8)
    assert not result.placement.group_gather_intra_node and result.placement.group_gather_nodes == 2
    assert "spans 2 nodes" in result.reason


def test_infeasible_group_size_is_planned_around():
    result = plan(_flux(group=12, prompts=1), Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=80 * GiB))
    bad = [c for c in result.candidates if not c.feasible and "does not split" in c.note]
    assert bad and all(c.layout.dp == 8 for c in bad) and "12 does not split over 8" in bad[0].note
    # pure TP (one data-parallel rank) cannot cast fp32 master weights to bf16: the trainer refuses it, so does the plan
    uncast = [c for c in result.candidates if not c.feasible and "casts" in c.note]
    assert uncast and all(c.layout.dp == 1 for c in uncast)
    assert all(c.feasible for c in result.candidates if c.layout.dp not in (1, 8))
    assert result.ok and 12 % result.layout.dp == 0


def test_refusal_names_the_smallest_peak():
    arch = load_arch("wan2.1-14b")
    work = Workload(arch=arch, tokens=arch.tokens(480, 832, 81), num_steps=20, selected_steps=19, group_size=8,
                    prompts_per_step=1, cfg=True)
    result = plan(work, Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=24 * GiB))
    assert not result.ok and result.schedule is None and result.placement is None
    assert result.reason.startswith("nothing fits in 24.0 GiB per GPU: the smallest predicted peak is")
    smallest = min(c.peak_mem_bytes for c in result.candidates if c.feasible)
    assert f"{smallest / GiB:.1f} GiB" in result.reason
    with pytest.raises(PlanError, match="nothing fits"):
        result.require()


def test_plan_to_dict_keys():
    out = plan(_flux(), CLUSTER).to_dict()
    assert {"schedule", "reason", "candidates", "placement"} <= set(out)
    need = {"schedule", "tp", "cp", "dp_shard", "dp_replicate", "generations_per_rank", "peak_mem_bytes", "fits",
            "step_time_s", "breakdown"}
    assert all(need <= set(c) for c in out["candidates"])
    first = out["candidates"][0]
    assert first["step_time_s"] == pytest.approx(sum(first["breakdown"]["time_s"].values()))
    assert len(out["placement"]["ranks"]) == 32


def test_plan_for_config_tiny():
    config = load_config(TINY_FLUX)
    result = plan_for_config(config, 2, gpus_per_node=2)
    assert result.schedule in SCHEDULES and result.layout in (Layout(1, 2, 1), Layout(1, 1, 2))
    fixed = plan_for_config(load_config(TINY_FLUX, ["parallel.dp_shard=1"]), 2, gpus_per_node=2)
    assert fixed.layout == Layout(1, 1, 2)
    with pytest.raises(PlanError, match="nothing fits"):
        plan_for_config(config, 2, gpus_per_node=2, gpu_mem_gb=1e-4)
    with pytest.raises(UserError, match="whole number of nodes"):
        plan_for_config(config, 3, gpus_per_node=2)


def test_predicted_peaks_of_a_config():
    one = predict_peak_bytes(load_config(TINY_FLUX, ["grpo.timestep_fraction=0.34"]))  # |S| = 1 of 3
    two = predict_peak_bytes(load_config(TINY_FLUX))  # |S| = 2
    assert set(one) == set(SCHEDULES) and all(v > 0 for v in one.values())
    assert two["retain"] > one["retain"]
    assert two["native"] == one["native"] and two["reweight"] == one["reweight"]


def test_config_text_tokens_follow_the_encoder():
    from leangrpo_mcore.engine.build import HASHED_TEXT_LENGTH
    from leangrpo_mcore.planner.layout import HASHED_TEXT_TOKENS, workload_from_config

    assert HASHED_TEXT_TOKENS == HASHED_TEXT_LENGTH
    assert workload_from_config(load_config(TINY_FLUX)).tokens["text"] == HASHED_TEXT_LENGTH
    diffusers_text = load_config(TINY_FLUX, ["model.text_encoder=diffusers"])
    assert workload_from_config(diffusers_text).tokens["text"] == 512


def test_peak_excluding_persistent_terms():
    est = predict_memory(load_config(TINY_FLUX, ["schedule.name=retain"]))["retain"]
    assert est.peak_mem_bytes == max(sum(p.values()) for p in est.phases.values())
    without = est.peak_excluding("weights", "optimizer", "reserved")
    expected = max(sum(v for k, v in p.items() if k not in ("weights", "optimizer", "reserved"))
                   for p in est.phases.values())
    assert without == expected and 0 < without < est.peak_mem_bytes


def test_planner_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, leangrpo_mcore.planner.layout, leangrpo_mcore.cli.plan; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_decode_and_cpu_optimizer_terms():
    config = load_config(TINY_FLUX, ["schedule.name=retain"])
    plain = predict_memory(config)["retain"]
    decoded = predict_memory(config, decode_bytes=50 * 2**20, device="cpu")["retain"]
    # Decoding happens while Retain still holds every kept graph.
    reward = decoded.phases["reward"]
    assert reward["decode"] == 50 * 2**20 and reward["activations"] == plain.phases["retain_graphs"]["activations"]
    assert decoded.peak_phase == "reward" and decoded.peak_mem_bytes > plain.peak_mem_bytes
    # torch's CPU AdamW updates one parameter at a time: far smaller temporaries than a foreach update.
    cpu, gpu = decoded.phases["optimizer_step"], plain.phases["optimizer_step"]
    assert cpu["optimizer_temporaries"] < gpu["optimizer_temporaries"] == gpu["weights"]


# ------------------------------------------------------------------------------------------- context parallelism
ONE_NODE = Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=80 * GiB)


def _wan_720p(**kw):
    """Wan2.1-14B, 1280x720 x 81 frames, CFG: one sample's activations alone exceed 80 GiB at CP = 1."""
    arch = load_arch("wan2.1-14b")
    return Workload(arch=arch, tokens=arch.tokens(720, 1280, 81), num_steps=16, selected_steps=8, group_size=8,
                    prompts_per_step=1, cfg=True, **kw)


def test_cp_divides_per_token_memory_and_fsdp_state_but_not_provisional_gradients():
    from leangrpo_mcore.planner.cost_model import estimate

    work = _wan_720p()
    # The same data-parallel size (2, so the same 4 generations per rank) with and without CP (4 and 8 ranks).
    one, two = Layout(2, 2, 1, cp=1), Layout(2, 2, 1, cp=2)
    assert one.dp == two.dp == 2 and (one.shard_ranks, two.shard_ranks) == (2, 4)
    for sched, phase, term in (("reweight", "provisional_gradients", "activations"),
                               ("retain", "retain_graphs", "activations"),
                               ("native", "native_update", "activations")):
        a, b = estimate(work, ONE_NODE, one, sched, True), estimate(work, ONE_NODE, two, sched, True)
        assert b.phases[phase][term] == pytest.approx(a.phases[phase][term] / 2, rel=1e-6)
        assert b.phases["rollout"]["rollout_working"] == pytest.approx(a.phases["rollout"]["rollout_working"] / 2,
                                                                        rel=1e-6)
        # FSDP2 shards over dp_shard x cp = 4 ranks instead of 2
        for key in ("weights", "optimizer"):
            assert b.phases["rollout"][key] == pytest.approx(a.phases["rollout"][key] / 2, rel=1e-6)
    a, b = estimate(work, ONE_NODE, one, "reweight", True), estimate(work, ONE_NODE, two, "reweight", True)
    assert b.details["activations_per_sample_bytes"] * 2 == pytest.approx(a.details["activations_per_sample_bytes"])
    # each CP rank holds a full-size partial gradient per in-flight sample
    assert b.details["provisional_grad_bytes"] == a.details["provisional_grad_bytes"] > 0
    assert b.phases["provisional_gradients"]["provisional_grads"] == a.phases["provisional_gradients"][
        "provisional_grads"]


def test_cp_time_halves_compute_and_adds_the_ulysses_all_to_alls():
    from leangrpo_mcore.planner.cost_model import step_time

    work = _wan_720p()
    one, two = Layout(2, 2, 1, cp=1), Layout(2, 2, 1, cp=2)
    for ac in (False, True):
        a, b = step_time(work, ONE_NODE, one, "native", ac), step_time(work, ONE_NODE, two, "native", ac)
        assert b["rollout"] == pytest.approx(a["rollout"] / 2) and b["backward"] == pytest.approx(a["backward"] / 2)
        assert a["cp_all_to_all"] == 0.0
        # 4 (cp-1)/cp x B x S/cp x H/tp x D x 2 bytes per self-attention layer (40; cross-attention exchanges
        # nothing), B = 2 with CFG, over 150 GB/s; per rank 2 samples x (16 rollout + 8 recompute forwards +
        # 8 backwards, each a forward's worth again with checkpointing)
        per_forward = 40 * 4 * 0.5 * 2 * (75600 / 2) * (40 / 2) * 128 * 2 / 150e9
        passes = 16 + 8 + 8 * (2 if ac else 1)
        assert b["cp_all_to_all"] == pytest.approx(4 * passes * per_forward, rel=1e-9)


def test_cp_is_chosen_when_one_sample_does_not_fit_and_the_reason_says_why():
    work = _wan_720p()
    assert not plan(work, ONE_NODE, cp=1).ok  # at CP = 1 nothing fits
    result = plan(work, ONE_NODE)
    assert result.ok and result.layout.cp > 1
    cp = result.layout.cp
    assert f"CP={cp} splits each sample's 75600 tokens over {cp} GPUs: nothing fits at CP=1" in result.reason
    assert f"parallel.cp={cp}" in result.reason and "schedule.name=auto refuses" in result.reason
    assert result.chosen.peak_mem_bytes <= 80 * GiB
    forced = plan(work, ONE_NODE, cp=2)  # half a sample per GPU is still too much
    assert {c.layout.cp for c in forced.candidates} == {2} and not forced.ok and cp == 4
    # CP peers sit next to each other, make the same generations and share a data-parallel index
    rows = result.placement.ranks
    for r in rows:
        assert r.dp_rank == r.rank // cp and r.cp_rank == r.rank % cp
        assert rows[r.rank - r.cp_rank].generations == r.generations
    assert sorted(g for r in rows if r.cp_rank == 0 for g in r.generations) == list(range(8))


def test_cp_is_not_chosen_when_it_only_adds_communication():
    result = plan(_flux(group=8, prompts=4), CLUSTER)
    assert result.ok and result.layout.cp == 1 and "CP=" not in result.reason
    assert any(c.layout.cp > 1 and c.fits for c in result.candidates)


def test_cp_wins_on_time_when_it_spares_activation_checkpointing():
    arch = load_arch("flux-dev")  # at 2560 px TP alone no longer spares checkpointing (activations split by TP too)
    work = Workload(arch=arch, tokens=arch.tokens(2560, 2560), num_steps=16, selected_steps=8, group_size=8,
                    prompts_per_step=1, lora_rank=64, lora_targets=("attn",))
    result = plan(work, ONE_NODE)
    fastest_single = min((c for c in result.candidates if c.fits and c.layout.cp == 1), key=lambda c: c.step_time_s)
    assert result.layout.cp > 1 and not result.chosen.activation_checkpointing
    assert fastest_single.activation_checkpointing and fastest_single.step_time_s > result.chosen.step_time_s
    assert (f"the fastest at CP=1 ({fastest_single.schedule.capitalize()} with TP=1") in result.reason
    assert (f"takes {fastest_single.step_time_s:.1f} s/step, mostly recomputing activations in backward (at CP=1 "
            f"it needs activation checkpointing to fit)") in result.reason


def test_cp_degree_is_validated():
    work = _wan_720p()
    with pytest.raises(UserError, match="cp=3 does not divide the 8 GPUs per node"):
        plan(work, ONE_NODE, cp=3)
    with pytest.raises(UserError, match="cp=16 does not divide the 40 attention heads"):
        plan(work, Hardware(nodes=1, gpus_per_node=16), cp=16)
    with pytest.raises(UserError, match="cp=4 with tp=4: tp x cp must divide"):
        plan(work, ONE_NODE, tp=4, cp=4)
    with pytest.raises(UserError, match="cp must be >= 1"):
        plan(work, ONE_NODE, cp=0)


def test_async_scoring_keeps_cp_1_as_the_trainer_does():
    work = _wan_720p(async_scoring=True)
    result = plan(work, ONE_NODE)
    assert {c.layout.cp for c in result.candidates} == {1} and not result.ok
    with pytest.raises(UserError, match="reward.async_scoring with parallel.cp=2"):
        plan(work, ONE_NODE, cp=2)


def test_config_cp_is_planned_as_written():
    config = load_config(TINY_FLUX, ["parallel.cp=2", "schedule.name=retain"])
    result = plan_for_config(config, 4, gpus_per_node=4)
    assert {c.layout.cp for c in result.candidates} == {2} and result.layout.cp == 2
    assert result.layout.tp * result.layout.cp * result.layout.dp == 4
    plain = predict_memory(load_config(TINY_FLUX, ["schedule.name=retain"]), world_size=2)["retain"]
    split = predict_memory(config, world_size=4)["retain"]
    assert split.layout == Layout(1, 2, 1, cp=2) and plain.layout == Layout(1, 2, 1)
    assert split.details["activations_per_sample_bytes"] * 2 == pytest.approx(
        plain.details["activations_per_sample_bytes"], abs=2)
    with pytest.raises(UserError, match="async_scoring"):
        plan_for_config(load_config(TINY_FLUX, ["parallel.cp=2", "reward.async_scoring=true"]), 4,
                        gpus_per_node=4)
