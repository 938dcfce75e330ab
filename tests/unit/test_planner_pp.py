"""Pipeline parallelism in the planner: the stages' layers, the schedules' makespans, the choice and its words."""

import json
import warnings
from dataclasses import replace

import pytest

from leangrpo_mcore.cli.plan import main as plan_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner import pipeline_time as pt
from leangrpo_mcore.planner.arch_specs import (
    arch_from_config,
    load_arch,
    param_counts,
    stage_block_counts,
    stage_spec,
)
from leangrpo_mcore.planner.cost_model import estimate, memory_phases
from leangrpo_mcore.planner.layout import enumerate_layouts, plan, plan_for_config
from leangrpo_mcore.planner.placement import place
from leangrpo_mcore.planner.workload import GiB, Hardware, Layout, Workload, sample_shape

# The Done-when cluster: 4 nodes of 8 x 40 GiB GPUs joined by 5 GB/s links, FLUX.1-dev full fine-tuning with
# groups of 32 generations.
DONE_WHEN = ["--model", "flux-dev", "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem-gb", "40",
             "--inter-node-gbps", "5", "--group-size", "32"]


def _run(argv, capsys):
    code = plan_main(argv)
    return code, capsys.readouterr()


# ---------------------------------------------------------------------------------------------- the stages
@pytest.mark.parametrize("total,pp", [(57, 1), (57, 2), (57, 4), (57, 5), (40, 3), (4, 4)])
def test_the_planner_splits_blocks_as_the_runtime_does(total, pp):
    from leangrpo_mcore.models.common.pipeline import split_blocks

    assert stage_block_counts(total, pp) == [len(s.blocks) for s in split_blocks(total, pp)]


@pytest.mark.parametrize("family,config,pp", [
    ("flux", {"preset": "flux-tiny", "num_layers": 2, "num_single_layers": 3}, 2),
    ("flux", {"preset": "flux-tiny", "num_layers": 2, "num_single_layers": 3}, 3),
    ("wan", {"preset": "tiny", "num_layers": 3}, 2),
])
def test_stage_specs_count_the_parameters_of_the_built_stages(family, config, pp):
    from leangrpo_mcore.models import build_policy, get_family
    from leangrpo_mcore.models.common.pipeline import split_blocks

    preset = dict(get_family(family).presets[config["preset"]])
    arch = arch_from_config(family, {**preset, **{k: v for k, v in config.items() if k != "preset"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stage in split_blocks(arch.num_layers, pp):
            model = build_policy({"family": family, **config}, backend="local", stage=stage)
            built = sum(p.numel() for p in model.parameters())
            assert param_counts(stage_spec(arch, pp, stage.rank))["total"] == built, stage
    assert sum(param_counts(stage_spec(arch, pp, k))["total"] for k in range(pp)) == param_counts(arch)["total"]


def test_flux_dev_stages_hold_their_blocks_and_the_end_layers():
    arch = load_arch("flux-dev")
    first, middle, last = (stage_spec(arch, 4, k) for k in (0, 1, 3))
    assert [(b.kind, b.count) for b in first.blocks] == [("double", 15)]
    assert [(b.kind, b.count) for b in middle.blocks] == [("double", 4), ("single", 10)]
    assert {lin.name for lin in first.root} >= {"x_embedder", "context_embedder"}
    assert [lin.name for lin in middle.root] == []
    assert {lin.name for lin in last.root} == {"norm_out.linear", "proj_out"}


# ------------------------------------------------------------------------------------------------ makespans
def _simulate_forward_only(f, h, m):
    """Event simulation: stage k starts micro-batch i when it is free and has received i from stage k - 1; a
    send blocks its sender until it has arrived (megatron-core's non-interleaved schedules wait on their p2p)."""
    arrive, free, done = [0.0] * m, [0.0] * len(f), 0.0
    for k in range(len(f)):
        for i in range(m):
            done = max(free[k], arrive[i]) + f[k]
            hop = h[k] if k < len(h) else 0.0
            free[k], arrive[i] = done + hop, done + hop
    return done


def _simulate_1f1b(f, b, u):
    """Event simulation of megatron's 1F1B order (warm-up forwards, one forward one backward, cool-down)."""
    pp = len(f)
    orders = []
    for k in range(pp):
        warm = min(pp - k - 1, u)
        ops = [("F", i) for i in range(warm)]
        for i in range(u - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(u - warm, u)]
        orders.append(ops)
    end, clock, pos = {}, [0.0] * pp, [0] * pp
    while any(pos[k] < len(orders[k]) for k in range(pp)):
        progressed = False
        for k in range(pp):
            if pos[k] == len(orders[k]):
                continue
            kind, i = orders[k][pos[k]]
            dep = (k - 1, "F", i) if kind == "F" and k else (k + 1, "B", i) if kind == "B" and k < pp - 1 else \
                (k, "F", i) if kind == "B" else None
            if dep is not None and dep not in end:
                continue
            start = max(clock[k], end[dep] if dep else 0.0)
            clock[k] = end[(k, kind, i)] = start + (f[k] if kind == "F" else b[k])
            pos[k] += 1
            progressed = True
        assert progressed
    return max(clock)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 5), (4, 3), (4, 16)])
def test_forward_only_makespan_against_an_event_simulation(pp, m):
    even, hops = [0.3] * pp, [0.05] * (pp - 1)
    span, p2p = pt.forward_only(even, hops, m)
    assert span == pytest.approx(_simulate_forward_only(even, hops, m))
    assert p2p == pytest.approx((pp - 1 + m - 1) * 0.05)
    uneven = [0.3 + 0.1 * k for k in range(pp)]
    assert pt.forward_only(uneven, hops, m)[0] >= _simulate_forward_only(uneven, hops, m) - 1e-12  # upper bound


@pytest.mark.parametrize("pp,u", [(2, 1), (2, 6), (4, 4), (4, 15)])
def test_1f1b_makespan_against_an_event_simulation(pp, u):
    f, b = [0.2] * pp, [0.4] * pp
    span, p2p = pt.one_f_one_b(f, b, [0.0] * (pp - 1), u)
    assert span == pytest.approx(_simulate_1f1b(f, b, u))
    assert span == pytest.approx((u + pp - 1) * 0.6)  # the textbook bubble: (pp - 1) units
    assert p2p == 0.0
    uneven_f, uneven_b = [0.2 + 0.05 * k for k in range(pp)], [0.4 - 0.05 * k for k in range(pp)]
    assert pt.one_f_one_b(uneven_f, uneven_b, [0.0] * (pp - 1), u)[0] >= _simulate_1f1b(uneven_f, uneven_b, u) - 1e-12


def test_boundaries_cross_nodes_only_between_nodes():
    hw = Hardware(nodes=2, gpus_per_node=4, intra_node_gbps=100.0, inter_node_gbps=10.0)
    per_node = pt.boundary_seconds(hw, Layout(4, 1, 1, 1, 2), 1e9)  # one stage per node
    assert per_node == pytest.approx([0.1])
    within = pt.boundary_seconds(hw, Layout(2, 1, 1, 1, 4), 1e9)  # two stages per node
    assert within == pytest.approx([0.01, 0.1, 0.01])


# ----------------------------------------------------------------------------------------------- the model
def _flux_work(**kw):
    arch = load_arch("flux-dev")
    return Workload(arch=arch, tokens=arch.tokens(512, 512), num_steps=16, selected_steps=15, group_size=32,
                    prompts_per_step=1, **kw)


def test_each_stage_holds_its_share_of_the_weights_and_native_keeps_pp_units_on_the_first():
    work, hw = _flux_work(activation_checkpointing=False), Hardware(nodes=4, gpus_per_node=8)
    whole = memory_phases(work, hw, Layout(4, 1, 8), "native", False)["native_update"]
    stages = [memory_phases(work, hw, Layout(4, 1, 2, 1, 4), "native", False, k)["native_update"]
              for k in range(4)]
    assert sum(s["weights"] for s in stages) == pytest.approx(whole["weights"], rel=1e-6)
    # 1F1B: stage k keeps the graphs of pp - k units in flight. One unit's graph on a stage (micro-batch 1) is
    # what Retain keeps per graph there: |S| x Q graphs of its blocks.
    retain = [memory_phases(work, hw, Layout(4, 1, 2, 1, 4), "retain", False, k)["retain_graphs"]
              for k in range(4)]
    per_unit = [r["activations"] / (15 * 16) for r in retain]
    assert per_unit[0] < whole["activations"]
    assert [s["activations"] / p for s, p in zip(stages, per_unit)] == pytest.approx([4, 3, 2, 1])


def test_a_no_grad_rollout_stage_holds_two_boundaries_whatever_the_micro_batch_count():
    work, hw = _flux_work(activation_checkpointing=False), Hardware(nodes=4, gpus_per_node=8)
    lay = Layout(4, 1, 2, 1, 4)
    arch, tokens = work.arch, work.tokens
    # FLUX sends [temb, text, image] rows of hidden_size per sample (bf16), two in flight on a stage that sends
    expected = 2 * (1 + tokens["joint"]) * arch.hidden_size * 2
    rollout = [memory_phases(work, hw, lay, "reweight", False, k)["rollout"] for k in range(4)]
    assert [r["rollout_boundaries"] for r in rollout] == [expected, expected, expected, 0]
    more = replace(work, group_size=64)
    assert memory_phases(more, hw, lay, "reweight", False, 0)["rollout"]["rollout_boundaries"] == expected


def test_reweight_pipelines_each_trained_step_and_reference_forwards_cost_how_they_run():
    work, hw, lay = _flux_work(), Hardware(nodes=4, gpus_per_node=8), Layout(4, 2, 1, 1, 4)

    def bubble_share(est):
        return est.time["pipeline_bubble"] / sum(est.time[k] for k in ("rollout", "recompute", "reference_forward",
                                                                        "backward", "tp_all_reduce"))

    # Reweight's trained step is one 1F1B schedule over the rank's Q samples: about (pp - 1) / Q of its compute
    # waits (lock-step passes would wait ~(pp - 1) x it), and the share falls as Q grows
    wide, narrow = (estimate(replace(work, group_size=g), hw, lay, "reweight", False) for g in (32, 8))
    assert 0.5 * 3 / 16 < bubble_share(wide) < 2 * 3 / 16
    assert 0.5 * 3 / 4 < bubble_share(narrow) < 2 * 3 / 4
    native = estimate(work, hw, lay, "native", False)
    assert native.time["pipeline_bubble"] < wide.time["pipeline_bubble"] < 3 * native.time["pipeline_bubble"]
    # with the KL term each sample is two units (the KL part's own forward is charged as a recompute)
    kl = estimate(_flux_work(kl_beta=0.01), hw, lay, "reweight", False)
    assert kl.time["recompute"] == pytest.approx(kl.time["reference_forward"])
    assert bubble_share(kl) < bubble_share(wide)
    # stage k holds pp - k one-sample graphs of the 1F1B schedule, the graph Retain keeps per (sample, step) there
    held = [memory_phases(work, hw, lay, "reweight", False, k)["provisional_gradients"]["activations"]
            for k in range(4)]
    graph = [memory_phases(work, hw, lay, "retain", False, k)["retain_graphs"]["activations"] / (15 * 16)
             for k in range(4)]
    assert [h / g for h, g in zip(held, graph)] == pytest.approx([4, 3, 2, 1])
    # KL reference forwards: one forward-only call over a group's units (one fill and drain), for Native and Retain
    for schedule in ("native", "retain"):
        plain, kl = (estimate(_flux_work(kl_beta=beta), hw, lay, schedule, False) for beta in (0.0, 0.01))
        added = kl.time["pipeline_bubble"] - plain.time["pipeline_bubble"]
        assert 0 < added < 0.05 * kl.time["reference_forward"], schedule


def test_placement_puts_stages_outermost():
    work, hw = _flux_work(), Hardware(nodes=4, gpus_per_node=8)
    lay = Layout(4, 1, 2, 1, 4)
    pl = place(lay, hw, sample_shape(work, lay), 32, 1)
    assert [r.pp_rank for r in pl.ranks] == [r // 8 for r in range(32)]
    assert [r.dp_rank for r in pl.ranks[:8]] == [r.dp_rank for r in pl.ranks[8:16]] == [0] * 4 + [1] * 4
    assert {r.node for r in pl.ranks if r.pp_rank == 2} == {2}


def test_layouts_combine_pp_with_cp_and_bad_degrees_are_one_line_errors():
    hw = Hardware(nodes=4, gpus_per_node=8)
    layouts = enumerate_layouts(24, hw, pp=None, num_layers=57)
    assert {lay.pp for lay in layouts} == {1, 2, 4, 8, 16, 32}
    assert {lay.cp for lay in layouts if lay.pp == 4} == {1, 2, 4, 8}  # a stage is one node: CP inside it
    assert {lay.cp for lay in layouts if lay.pp == 16} == {1, 2}  # a stage is 2 GPUs
    assert all(lay.world_size == 32 for lay in layouts)
    with pytest.raises(UserError, match="pp=3 does not split"):
        enumerate_layouts(24, hw, pp=3, num_layers=57)
    both = enumerate_layouts(24, hw, pp=2, cp=2, num_layers=57)
    assert both and all((lay.pp, lay.cp) == (2, 2) for lay in both)
    with pytest.raises(UserError, match="pp=64 does not split"):
        enumerate_layouts(24, Hardware(nodes=8, gpus_per_node=8), pp=64, num_layers=57)


# --------------------------------------------------------------------------------------------- the choice
def test_done_when_picks_pipeline_stages_across_slow_links(capsys):
    code, out = _run(DONE_WHEN + ["--json"], capsys)
    assert code == 0, out.err
    data = json.loads(out.out)
    chosen = data["chosen"]
    assert chosen["pp"] > 1 and chosen["schedule"] in ("native", "retain")  # Reweight's provisional grads do not fit
    assert {c["pp"] for c in data["candidates"]} == {1, 2, 4, 8, 16, 32}
    assert f"PP={chosen['pp']} splits the 57 blocks" in data["reason"]
    assert "5 GB/s links between nodes" in data["reason"]
    # the best layout without stages is slower, by its gradient all-reduces over the slow links
    flat = [c for c in data["candidates"] if c["pp"] == 1 and c["fits"]]
    best_flat = min(flat, key=lambda c: c["step_time_s"])
    assert best_flat["step_time_s"] > 1.3 * chosen["step_time_s"]
    extra = {k: v - chosen["breakdown"]["time_s"][k] for k, v in best_flat["breakdown"]["time_s"].items()}
    assert max(extra, key=extra.get) == "grad_sync"
    assert "mostly gradient synchronisation" in data["reason"]
    assert f"parallel.pp={chosen['pp']}" in data["reason"]
    code, out = _run(DONE_WHEN + ["--top", "3"], capsys)
    header = next(line for line in out.out.splitlines() if line.startswith("schedule  pp"))
    assert "bubble" in header


def test_a_faster_link_shrinks_what_pp_one_pays_for_it():
    work = _flux_work()
    slow = plan(work, Hardware(nodes=4, gpus_per_node=8, gpu_mem_bytes=40 * GiB, inter_node_gbps=5.0))
    fast = plan(work, Hardware(nodes=4, gpus_per_node=8, gpu_mem_bytes=40 * GiB, inter_node_gbps=50.0))

    def best(result, pp_one):
        pool = [c for c in result.candidates if c.fits and c.feasible and (c.layout.pp == 1) == pp_one]
        return min(pool, key=lambda c: c.step_time_s)

    # one stage per node: a stage's gradient all-reduces stay inside its node; at pp = 1 they cross the links
    for lay, crosses in ((Layout(4, 1, 2, 1, 4), False), (Layout(4, 1, 8), True)):
        sync = [estimate(work, Hardware(nodes=4, gpus_per_node=8, inter_node_gbps=bw), lay, "native", False)
                .time["grad_sync"] for bw in (5.0, 50.0)]
        assert (sync[0] > 2 * sync[1]) if crosses else sync[0] == pytest.approx(sync[1]), lay
    gap_slow = best(slow, True).step_time_s - best(slow, False).step_time_s
    gap_fast = best(fast, True).step_time_s - best(fast, False).step_time_s
    assert gap_slow > gap_fast + 5.0


def test_cli_pp_flag_fixes_the_degree_and_refusals_are_one_line(capsys):
    code, out = _run(DONE_WHEN + ["--pp", "1", "--json"], capsys)
    assert code == 0 and {c["pp"] for c in json.loads(out.out)["candidates"]} == {1}
    code, out = _run(DONE_WHEN + ["--pp", "2", "--cp", "2", "--json"], capsys)
    data = json.loads(out.out)
    assert code == 0 and {(c["pp"], c["cp"]) for c in data["candidates"]} == {(2, 2)}
    assert data["reason"].count("Run it with") == 1
    assert data["reason"].endswith(f"Run it with schedule.name={data['chosen']['schedule']} parallel.pp=2 "
                                   "parallel.cp=2 (schedule.name=auto refuses parallel.cp > 1).")
    for extra, message in ((["--pp", "3"], "pp=3 does not split"),
                           (["--pp", "4", "--simulate"], "does not simulate pipeline stages")):
        code, out = _run(DONE_WHEN + extra, capsys)
        assert code == 2, extra
        assert message in out.err and len(out.err.strip().splitlines()) == 1, out.err


def test_schedule_auto_plans_at_the_configs_pp():
    from leangrpo_mcore.engine.build import resolve_plan
    import logging

    import torch

    from leangrpo_mcore.engine.launch import DistContext
    from leangrpo_mcore.planner import hardware_preset

    config = load_config("yaml_configs/tiny/flux.yaml", ["schedule.name=auto", "parallel.pp=2",
                                                         "parallel.memory_budget_gb=8"])
    result = plan_for_config(config, 2, gpus_per_node=2, gpu_mem_gb=8, **hardware_preset("cpu"))
    assert result.layout.pp == 2 and result.schedule in ("native", "retain", "reweight")
    resolved = resolve_plan(config, DistContext(0, 2, 0, torch.device("cpu"), "gloo", False), logging.getLogger("t"))
    assert resolved.schedule.name == result.schedule and resolved.parallel.pp == 2
