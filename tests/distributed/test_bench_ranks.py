"""The benchmark tool on two gloo ranks with FSDP2: rank 0 reports, the sweep path, gradients agree, and Native is
also timed replicated (the strongest baseline)."""

import json

import pytest

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

SMOKE = "yaml_configs/bench/smoke.yaml"
BUDGET = "parallel.memory_budget_gb=11"


def _trainer_layout(world_size: int) -> tuple[str, object]:
    """(layout name, reshard_after_forward) the trainer resolves the smoke config's auto keys to at ``world_size``."""
    import logging

    import torch

    from leangrpo_mcore.bench.arms import layout_name
    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine.build import resolve_plan
    from leangrpo_mcore.engine.launch import DistContext

    config = load_config(SMOKE, ["grpo.timestep_fraction=0.34", BUDGET])
    resolved = resolve_plan(config, DistContext(0, world_size, 0, torch.device("cpu"), "gloo", False),
                            logging.getLogger("test"))
    p = resolved.parallel
    return layout_name(int(p.dp_shard), int(p.dp_replicate)), p.reshard_after_forward


def _bench(rank, world_size, out):
    from leangrpo_mcore.cli.bench import main

    code = main(["--config", SMOKE, "--schedules", "native,native_coalesced,reweight", "--steps", "1", "--warmup",
                 "0", "--no-memory", "--check-parity", "--sweep", "grpo.timestep_fraction=0.34",
                 "--json", out, BUDGET])
    return code


def test_two_rank_run_reports_once_with_matching_gradients(tmp_path):
    out = str(tmp_path / "bench.json")
    assert run_ranks(_bench, 2, out, timeout=180) == [0, 0]
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["sweep"] == {"key": "grpo.timestep_fraction", "values": ["0.34"]}
    assert len(document["runs"]) == 1
    for run in document["runs"]:
        meta, shape, ideal = run["meta"], run["shape"], run["ideal"]
        assert (meta["world_size"], meta["dp_size"], shape["samples_per_rank"]) == (2, 2, 1)
        assert shape["steps_per_sample"] == 1 and meta["title"].endswith("grpo.timestep_fraction=0.34")
        # At two data-parallel ranks Native's backward also reduce-scatters: B comes from coalesced Native.
        assert (ideal["forward_source"], ideal["backward_source"]) == ("native", "native_coalesced")
        for entry in run["schedules"].values():
            step = entry["steps"][0]
            assert sum(step["phases_s"].values()) == pytest.approx(step["time_s"], rel=1e-9)
            assert min(step["phases_s"].values()) >= -1e-6 and entry["peak_memory_bytes"] is None
        for name in ("native_coalesced", "reweight"):
            assert run["parity"][name]["cosine"] > 1 - 1e-6 and run["parity"][name]["rel_l2"] < 1e-4
        # Native on the other layout, with both syncs, joins the listed schedules; the best of the four leads.
        # The plain labels run the trainer's layout (its auto keys resolved by the planner), the others the other.
        own, gathering = _trainer_layout(2)
        other = "sharded" if own == "replicated" else "replicated"
        assert (meta["layout"], meta["reshard_after_forward"]) == (own, gathering)
        natives = ["native", "native_coalesced", f"native@{other}", f"native_coalesced@{other}"]
        assert meta["order"] == ["native", "native_coalesced", "reweight", *natives[2:]]
        assert meta["layouts"] == {"native": own, "native_coalesced": own, "reweight": own,
                                   natives[2]: other, natives[3]: other}
        medians = {n: run["schedules"][n]["step_time_s"]["median"] for n in natives}
        best = run["baselines"]["best"]
        assert best == min(medians, key=medians.get)
        assert run["baselines"]["fsdp"] == ("native" if own == "sharded" else "native@sharded")
        reweight = run["schedules"]["reweight"]
        assert reweight["speedup_vs_best"] == pytest.approx(medians[best] / reweight["step_time_s"]["median"])
        for name in natives:  # every layout runs the same forwards (one sample per rank, T = 3, |S| = 1)
            rows = run["schedules"][name]["steps"][0]["forward_rows"]
            assert rows == {"nograd": 3, "rollout_grad": 0, "recompute": 1, "reference": 0}
            assert run["schedules"][name]["throughput"]["samples_per_s_per_device"] == pytest.approx(
                1 / run["schedules"][name]["step_time_s"]["median"])
