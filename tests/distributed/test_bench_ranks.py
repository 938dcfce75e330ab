"""The benchmark tool on two gloo ranks with FSDP2: rank 0 reports, the sweep path, gradients agree."""

import json

import pytest

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

SMOKE = "yaml_configs/bench/smoke.yaml"


def _bench(rank, world_size, out):
    from leangrpo_mcore.cli.bench import main

    code = main(["--config", SMOKE, "--schedules", "native,native_coalesced,reweight", "--steps", "1", "--warmup",
                 "0", "--no-memory", "--check-parity", "--sweep", "grpo.timestep_fraction=0.34",
                 "--json", out])
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
