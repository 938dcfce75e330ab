"""The trainer's ``auto`` layout keys: resolved to ``leangrpo-plan --json``'s choice, the plan's override line
reproduces it, the gathering modes' terms against hand counts, and resumes of resolved configs."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import pytest
import torch
import yaml

from leangrpo_mcore.cli.plan import main as plan_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.config.drift import config_changes
from leangrpo_mcore.config.loader import config_to_yaml
from leangrpo_mcore.engine.auto_layout import auto_keys
from leangrpo_mcore.engine.build import resolve_plan
from leangrpo_mcore.engine.launch import DistContext
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.arch_specs import (arch_from_config, largest_block_params, load_arch, params_per_rank,
                                               preset_config)
from leangrpo_mcore.planner.cost_model import estimate, memory_phases, step_time
from leangrpo_mcore.planner.gather_cost import full_gathers, gathered_elements
from leangrpo_mcore.planner.workload import GiB, Hardware, Layout, Workload, hardware_preset, sample_shape

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
BENCH_FLUX = os.path.join(ROOT, "yaml_configs/bench/flux_flowgrpo.yaml")
LOG = logging.getLogger("test")


def _dist(world_size: int) -> DistContext:
    return DistContext(0, world_size, 0, torch.device("cpu"), "gloo", False)


def _plan_json(capsys, path: str, overrides: list[str], world_size: int, memory_gb: float) -> dict:
    argv = ["--config", path, *overrides, "--schedule", "config", "--hardware", "cpu", "--gpus-per-node",
            str(world_size), "--gpu-mem-gb", str(memory_gb), "--json"]
    code = plan_main(argv)
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if out["chosen"] else 1)
    return out


CASES = [
    ("yaml_configs/bench/flux_flowgrpo.yaml", [], 2, 11.0),
    ("yaml_configs/bench/flux_flowgrpo.yaml", [], 2, 1.16),
    ("yaml_configs/bench/flux_flowgrpo.yaml", ["schedule.name=native"], 4, 1.16),
    ("yaml_configs/bench/flux_flowgrpo.yaml", ["schedule.name=auto", "model.activation_checkpointing=auto"], 4, 1.12),
    ("yaml_configs/bench/flux_flowgrpo_lora.yaml", [], 4, 8.0),
    ("yaml_configs/bench/wan_dancegrpo.yaml", ["schedule.name=retain"], 2, 8.0),
    ("yaml_configs/tiny/flux.yaml", [], 1, 8.0),
    ("yaml_configs/tiny/wan.yaml", ["parallel.dp_replicate=1"], 2, 4.0),
]


@pytest.mark.parametrize("path,overrides,world_size,memory_gb", CASES)
def test_auto_resolves_to_the_plans_choice(capsys, monkeypatch, path, overrides, world_size, memory_gb):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    path = os.path.join(ROOT, path)
    config = load_config(path, [*overrides, f"parallel.memory_budget_gb={memory_gb}"])
    resolved = resolve_plan(config, _dist(world_size), LOG)
    out = _plan_json(capsys, path, overrides, world_size, memory_gb)
    chosen = out["chosen"]
    assert chosen is not None
    got = {"schedule.name": resolved.schedule.name, "parallel.tp": resolved.parallel.tp,
           "parallel.pp": resolved.parallel.pp, "parallel.cp": resolved.parallel.cp,
           "parallel.dp_shard": resolved.parallel.dp_shard, "parallel.dp_replicate": resolved.parallel.dp_replicate,
           "parallel.reshard_after_forward": resolved.parallel.reshard_after_forward,
           "model.activation_checkpointing": resolved.model.activation_checkpointing}
    assert got == {"schedule.name": chosen["schedule"], "parallel.tp": chosen["tp"], "parallel.pp": chosen["pp"],
                   "parallel.cp": chosen["cp"], "parallel.dp_shard": chosen["dp_shard"],
                   "parallel.dp_replicate": chosen["dp_replicate"],
                   "parallel.reshard_after_forward": chosen["reshard_after_forward"],
                   "model.activation_checkpointing": chosen["activation_checkpointing"]}
    assert out["overrides"] == " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in got.items())
    # the fastest of the fitting candidates the JSON lists (of the schedule the config names)
    fitting = [c for c in out["candidates"] if c["fits"] and c["feasible"]]
    assert chosen["step_time_s"] == min(c["step_time_s"] for c in fitting)
    assert chosen["peak_mem_bytes"] <= memory_gb * GiB
    assert not auto_keys(resolved)


@pytest.mark.parametrize("path,overrides,world_size,memory_gb", CASES[:5])
def test_the_override_line_reproduces_the_plan(capsys, monkeypatch, path, overrides, world_size, memory_gb):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    path = os.path.join(ROOT, path)
    first = _plan_json(capsys, path, overrides, world_size, memory_gb)
    again = _plan_json(capsys, path, [*overrides, *first["overrides"].split()], world_size, memory_gb)
    assert again["overrides"] == first["overrides"]
    assert len(again["candidates"]) == 1  # every degree, the gathering and checkpointing fixed
    for key in ("step_time_s", "peak_mem_bytes", "breakdown"):
        assert again["chosen"][key] == first["chosen"][key]
    # and the trainer resolves nothing more
    config = load_config(path, [*overrides, *first["overrides"].split()])
    assert not auto_keys(config) and resolve_plan(config, _dist(world_size), LOG) is config


def test_cpu_world_size_2_replicates_the_flux_bench(monkeypatch):
    """The motivating case: on a CPU host with room, both ranks hold the whole model (FSDP2's per-forward
    all-gathers and gloo's slow reduce-scatter cost more than an all-reduce per update)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for schedule in ("native", "reweight"):
        config = load_config(BENCH_FLUX, [f"schedule.name={schedule}", "parallel.memory_budget_gb=11"])
        resolved = resolve_plan(config, _dist(2), LOG)
        assert (resolved.parallel.dp_shard, resolved.parallel.dp_replicate) == (1, 2)
        assert resolved.parallel.reshard_after_forward in (False, "rollout")
    # with too little memory for a whole copy per rank, FSDP2 shards over both
    config = load_config(BENCH_FLUX, ["parallel.memory_budget_gb=1.16"])
    assert resolve_plan(config, _dist(2), LOG).parallel.dp_shard == 2


def test_the_choice_is_logged_in_one_line(caplog, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = load_config(BENCH_FLUX, ["parallel.memory_budget_gb=11"])
    with caplog.at_level(logging.INFO, logger="test"):
        resolve_plan(config, _dist(2), LOG)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto layout:")]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "parallel.dp_shard=1 parallel.dp_replicate=2" in lines[0]
    assert "11.00 GiB per rank (parallel.memory_budget_gb)" in lines[0] and "Reweight with" in lines[0]


def test_nothing_fits_keeps_the_default_layout(caplog, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = load_config(BENCH_FLUX, ["parallel.memory_budget_gb=0.5", "model.activation_checkpointing=auto"])
    with caplog.at_level(logging.WARNING, logger="test"):
        resolved = resolve_plan(config, _dist(2), LOG)
    assert resolved.parallel.dp_shard == "auto" and resolved.model.activation_checkpointing is False
    assert any("nothing fits" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match="nothing fits"):
        resolve_plan(load_config(BENCH_FLUX, ["parallel.memory_budget_gb=0.5", "schedule.name=auto"]), _dist(2),
                     LOG)


def test_a_resolved_config_resumes_without_drift(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = load_config(BENCH_FLUX, ["parallel.memory_budget_gb=11", "model.activation_checkpointing=auto"])
    resolved = resolve_plan(config, _dist(2), LOG)
    saved = yaml.safe_load(config_to_yaml(resolved))
    assert saved["parallel"]["dp_replicate"] == 2 and saved["model"]["activation_checkpointing"] is False
    assert config_changes(saved, resolve_plan(config, _dist(2), LOG)) == []
    # another resolution of keys the user left auto (another world size, memory) is applied, not refused
    other = resolve_plan(load_config(BENCH_FLUX, ["parallel.memory_budget_gb=1.16", "schedule.name=auto"]),
                         _dist(2), LOG)
    changes = config_changes(saved, replace(other, schedule=replace(other.schedule, name="native")),
                             planned=frozenset(auto_keys(config) + ["schedule.name"]))
    assert {c.key for c in changes} >= {"parallel.dp_shard", "schedule.name"} and all(c.applied for c in changes)
    assert not all(c.applied for c in config_changes(saved, replace(other, schedule=replace(other.schedule,
                                                                                            name="native"))))


# -- the gathering modes in the planner, against hand counts -------------------------------------------------------

TINY = arch_from_config("flux", preset_config("flux", "flux-tiny"), "flux-tiny")


def _work(**changes) -> Workload:
    # T = 4, |S| = 3; 2 prompts of 4 over 2 ranks: 2 groups of 2 generations per rank, micro-batch 1
    base = Workload(arch=TINY, tokens=TINY.tokens(128, 128, 1, 16), num_steps=4, selected_steps=3, group_size=4,
                    prompts_per_step=2)
    return replace(base, **changes)


@pytest.mark.parametrize("schedule", ["native", "retain", "reweight"])
def test_full_gathers_against_a_hand_count(schedule):
    work, layout = _work(), Layout(tp=1, dp_shard=2, dp_replicate=1)
    shape = sample_shape(work, layout)
    assert (shape.groups_per_rank, shape.micro_batches, shape.samples) == (2, 4, 4)
    T, S, groups, mb, n = 4, 3, 2, 4, 4
    forwards = T + (S if schedule == "native" else 0)
    if schedule == "reweight":
        hand = {"forward": mb * (T - S) + n * 2 * S, "rollout": groups, "step": 1}
    else:
        hand = {"forward": mb * (forwards + S), "rollout": groups + mb * (forwards - T + S), "step": 1}
    for mode, count in hand.items():
        assert full_gathers(work, shape, schedule, mode) == count
    # two updates per rollout: the optimizer step frees the gathered copies, the second update gathers again
    twice = _work(updates_per_rollout=2)
    assert full_gathers(twice, sample_shape(twice, layout), schedule, "step") == 2


def test_gather_time_and_memory_against_a_hand_count():
    hw = Hardware(nodes=1, gpus_per_node=2, intra_node_gbps=2.0, hbm_gbps=10.0, collective_latency_s=1e-3)
    layout = Layout(tp=1, dp_shard=2, dp_replicate=1)
    dev = load_arch("flux-dev")
    params, largest = params_per_rank(dev, 1), largest_block_params(dev, 1)
    root = sum(lin.params for lin in dev.root)
    units = 19 + 38 + 1  # FLUX.1-dev: 19 double- and 38 single-stream blocks, and the root
    one = 0.5 * params * 2 / 2e9 + params * 2 / 10e9 + units * 1e-3  # bf16: 2 bytes an element
    few = (2 * largest + root) * 2
    for mode, gathers in (("forward", 4 * (4 + 3 + 3)), ("rollout", 2 + 4 * (3 + 3)), ("step", 1)):
        work = _work(arch=dev, tokens=dev.tokens(256, 256, 1, 16),
                     reshard_after_forward={"forward": True, "rollout": "rollout", "step": False}[mode])
        assert step_time(work, hw, layout, "native", False)["fsdp_all_gather"] == pytest.approx(gathers * one)
        phases = memory_phases(work, hw, layout, "native", False)
        assert phases["rollout"]["gathered_params"] == (few if mode == "forward" else params * 2)
        assert phases["native_update"]["gathered_params"] == (params * 2 if mode == "step" else few)
    assert gathered_elements(dev, Layout(tp=1, dp_shard=1, dp_replicate=1), "step") == (0, 0)  # no FSDP


def test_the_planner_tries_every_mode_and_refuses_regathering_where_the_engine_does():
    dance = _work(selection="dance_grpo", reshard_after_forward=True)
    layout, hw = Layout(tp=1, dp_shard=2, dp_replicate=1), Hardware(nodes=1, gpus_per_node=2)
    refused = estimate(dance, hw, layout, "reweight", False)
    assert not refused.feasible and "cannot regather" in refused.note
    assert estimate(replace(dance, reshard_after_forward="rollout"), hw, layout, "reweight", False).feasible
    from leangrpo_mcore.planner.layout import plan

    result = plan(_work(reshard_after_forward="auto"), Hardware(nodes=1, gpus_per_node=2, **hardware_preset("cpu")),
                  tp=1, cp=1, pp=1)
    modes = {(c.layout.dp_shard, c.gather_mode) for c in result.candidates}
    assert modes == {(s, m) for s in (1, 2) for m in ("forward", "rollout", "step")}


def test_one_process_casting_to_bf16_is_planned(monkeypatch):
    """One process with bf16 forwards over fp32 master weights: FSDP2 over a one-rank mesh casts them, so the
    layout is feasible (not the two-rank TP-only case, which the trainer refuses)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = load_config(os.path.join(ROOT, "yaml_configs/tiny/flux.yaml"),
                         ["model.dtype=bfloat16", "parallel.memory_budget_gb=8"])
    resolved = resolve_plan(config, _dist(1), LOG)
    assert (resolved.parallel.dp_shard, resolved.parallel.dp_replicate) == (1, 1)
    two_tp = load_config(os.path.join(ROOT, "yaml_configs/tiny/flux.yaml"),
                         ["model.dtype=bfloat16", "parallel.tp=2", "schedule.name=auto"])
    with pytest.raises(UserError, match="nothing casts"):
        resolve_plan(two_tp, _dist(2), LOG)
