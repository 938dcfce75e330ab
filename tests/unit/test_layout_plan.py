"""Planner decisions, multi-node placement, refusals and the config entry points."""

import pytest

from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.parallel.arch_specs import load_arch
from leangrpo_mcore.parallel.workload import SCHEDULES, GiB, Hardware, Layout, Workload, sample_shape
from leangrpo_mcore.parallel.layout import (
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
    need = {"schedule", "tp", "dp_shard", "dp_replicate", "generations_per_rank", "peak_mem_bytes", "fits",
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
    from leangrpo_mcore.parallel.layout import HASHED_TEXT_TOKENS, workload_from_config

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

    code = ("import sys, leangrpo_mcore.parallel.layout, leangrpo_mcore.cli.plan; "
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
