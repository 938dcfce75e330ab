"""The `leangrpo-plan` command: JSON and table output, refusals, one-line errors with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from leangrpo_mcore.cli.plan import main

HW = ["--gpus-per-node", "8", "--gpu-mem-gb", "80"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output(capsys):
    out = _json(capsys, ["--model", "wan2.1-1.3b", "--nodes", "2", *HW, "--resolution", "480x832", "--frames", "33",
                         "--num-steps", "20", "--selected-steps", "10", "--group-size", "16", "--lora-rank", "32",
                         "--kl-beta", "0.004", "--intra-node-gbps", "300", "--inter-node-gbps", "50",
                         "--gpu-tflops", "989"])
    assert out["schedule"] in ("native", "retain", "reweight") and out["reason"]
    assert out["world_size"] == 16 and len(out["placement"]["ranks"]) == 16
    keys = {"schedule", "tp", "dp_shard", "dp_replicate", "generations_per_rank", "peak_mem_bytes", "fits",
            "step_time_s", "breakdown"}
    assert out["candidates"] and all(keys <= set(c) for c in out["candidates"])
    chosen = out["chosen"]
    assert chosen["fits"] and chosen["schedule"] == out["schedule"]
    assert chosen["step_time_s"] == min(c["step_time_s"] for c in out["candidates"] if c["fits"] and c["feasible"])
    # KL with Reweight costs a second backward per selected step: visible in its breakdown.
    rw = [c for c in out["candidates"] if c["schedule"] == "reweight" and c["feasible"]][0]
    rt = [c for c in out["candidates"] if c["schedule"] == "retain" and c["tp"] == rw["tp"]
          and c["dp_shard"] == rw["dp_shard"] and c["activation_checkpointing"] == rw["activation_checkpointing"]][0]
    assert rw["breakdown"]["time_s"]["backward"] == pytest.approx(2 * rt["breakdown"]["time_s"]["backward"])


def test_flags_change_the_answer(capsys):
    base = ["--model", "flux-dev", *HW, "--gpu-mem-gb", "48", "--resolution", "512", "--group-size", "16"]
    assert _json(capsys, base + ["--micro-batch", "2"])["schedule"] != "reweight"
    checkpointed = _json(capsys, base[:-2] + ["--group-size", "8", "--activation-checkpointing"])
    assert all(c["activation_checkpointing"] for c in checkpointed["candidates"])
    fp8 = _json(capsys, base[:-2] + ["--group-size", "8", "--precision", "fp8"])
    bf16 = _json(capsys, base[:-2] + ["--group-size", "8"])
    assert fp8["chosen"]["breakdown"]["time_s"]["rollout"] < bf16["chosen"]["breakdown"]["time_s"]["rollout"]


def test_table_output_and_config(capsys):
    assert main(["--config", os.path.join(ROOT, "yaml_configs/tiny/wan.yaml"), "grpo.group_size=4",
                 "--gpus-per-node", "2", "--gpu-mem-gb", "4"]) == 0
    text = capsys.readouterr().out
    assert "schedule: " in text and "placement (" in text and "M=4" in text
    # 3 schedules x 2 layouts (FSDP over 2, or 2 replicas) x 3 FSDP2 gathering modes
    assert sum(1 for line in text.splitlines() if line.startswith(("native", "retain", "reweight"))) == 18
    run = [line for line in text.splitlines() if line.startswith("run it with: ")]
    assert len(run) == 1 and "parallel.dp_shard=" in run[0] and "model.activation_checkpointing=false" in run[0]


def test_refusal_exits_1_and_still_prints(capsys):
    argv = ["--model", "wan2.1-14b", "--gpus-per-node", "8", "--gpu-mem-gb", "24", "--resolution", "480x832",
            "--frames", "81", "--json"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] is None and out["reason"].startswith("nothing fits") and out["placement"] is None


@pytest.mark.parametrize("argv,message", [
    (["--model", "flux-xl", *HW], "unknown model 'flux-xl'"),
    (["--model", "flux-dev", "--config", "x.yaml", *HW], "exactly one of --model and --config"),
    (["--model", "flux-dev", *HW, "--resolution", "big"], "--resolution must be"),
    (["--model", "flux-dev", *HW, "--resolution", "500"], "multiples of 16"),
    (["--model", "flux-dev", *HW, "--selected-steps", "40"], "exceed the steps"),
    (["--model", "flux-dev", *HW, "a.b=1"], "needs --config"),
    (["--config", "yaml_configs/tiny/flux.yaml", *HW, "--frames", "5"], "--frames cannot be combined"),
    (["--config", "missing.yaml", *HW], "config file not found"),
    (["--model", "flux-dev", "--gpus-per-node", "0", "--gpu-mem-gb", "80"], "gpus per node >= 1"),
    (["--model", "flux-dev", *HW, "--efficiency", "nan"], "--efficiency must be a finite number, got nan"),
    (["--model", "flux-dev", *HW, "--gpu-tflops", "inf"], "--gpu-tflops must be a finite number, got inf"),
    (["--model", "flux-dev", "--gpus-per-node", "8", "--gpu-mem-gb=-inf"], "--gpu-mem-gb must be a finite number"),
    (["--model", "flux-dev", *HW, "--kl-beta", "nan"], "--kl-beta must be a finite number, got nan"),
    (["--model", "flux-dev", *HW, "--overhead-gb", "-1"], "--overhead-gb must be >= 0, got -1.0"),
    (["--model", "flux-dev", *HW, "--reward-mem-gb", "-0.5"], "--reward-mem-gb must be >= 0, got -0.5"),
    (["--model", "flux-dev", *HW, "--top", "-3"], "--top must be >= 0, got -3"),
    (["--config", "yaml_configs/tiny/flux.yaml", *HW, "optim.lr=nan"], "'optim.lr' must be a finite number"),
    (["--model", "flux-dev", *HW, "--cp", "3"], "cp=3 does not divide the 8 GPUs per node"),
    (["--model", "flux-dev", *HW, "--cp", "0"], "cp must be >= 1, got 0"),
    (["--model", "wan2.1-14b", "--gpus-per-node", "16", "--gpu-mem-gb", "80", "--cp", "16"],
     "cp=16 does not divide the 40 attention heads"),
    (["--config", "yaml_configs/tiny/flux.yaml", *HW, "--cp", "2"], "--cp cannot be combined with a YAML config"),
    (["--config", "yaml_configs/tiny/flux.yaml", *HW, "parallel.cp=2", "reward.async_scoring=true"],
     "reward.async_scoring with parallel.cp=2 is not supported"),
])
def test_errors_are_one_line_exit_2(capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_missing_required_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "flux-dev"])
    assert exc.value.code == 2 and "--gpus-per-node" in capsys.readouterr().err


def test_tool_wrapper_runs():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_layout.py"), "--model", "flux-dev",
                           *HW, "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schedule"] in ("native", "retain", "reweight")


def test_large_cluster_table_is_truncated(capsys):
    assert main(["--model", "flux-dev", "--nodes", "16", *HW, "--top", "3", "--lora-rank", "16"]) == 0
    text = capsys.readouterr().out
    assert "more (--top 0 shows all)" in text and "64 more ranks (--json lists all)" in text


def _plan_cli(*argv):
    return subprocess.run([sys.executable, "-m", "leangrpo_mcore.cli.plan", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_simulate_all_reports_simulated_next_to_predicted():
    proc = _plan_cli("--config", "yaml_configs/tiny/flux.yaml", "--gpus-per-node", "2", "--gpu-mem-gb", "80",
                     "--simulate", "all", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    simulated = [c for c in out["candidates"] if "simulated_peak_bytes" in c]
    assert sorted(c["schedule"] for c in simulated) == ["native", "retain", "reweight"]
    for c in simulated:
        breakdown = c["simulated_breakdown"]
        assert c["simulated_peak_bytes"] == sum(breakdown.values()) and breakdown["parameters"] > 0
        assert c["simulated_over_predicted"] == pytest.approx(c["simulated_peak_bytes"] / c["peak_mem_bytes"],
                                                                rel=1e-3)
        assert c["not_simulated"] and c["peak_mem_bytes"] > 0
    assert "simulating 3/3" in proc.stderr


def test_simulate_chosen_when_nothing_fits_is_one_line():
    proc = _plan_cli("--model", "flux-dev", "--gpus-per-node", "1", "--gpu-mem-gb", "1", "--simulate")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "nothing fits" in proc.stderr


WAN_720P = ["--model", "wan2.1-14b", "--nodes", "1", *HW, "--resolution", "1280x720", "--frames", "81",
            "--num-steps", "16", "--selected-steps", "8", "--group-size", "8"]


def test_long_video_picks_context_parallelism_and_says_why(capsys):
    out = _json(capsys, WAN_720P)
    chosen = out["chosen"]
    assert chosen["cp"] > 1 and chosen["fits"] and chosen["peak_mem_bytes"] <= 80 * 2**30
    assert chosen["breakdown"]["time_s"]["cp_all_to_all"] > 0
    assert f"CP={chosen['cp']} splits each sample's 75600 tokens over {chosen['cp']} GPUs: nothing fits at CP=1" \
        in out["reason"]
    assert "one sample's activations per trained step are 65.3 GiB at CP=1" in out["reason"]
    assert all(not c["fits"] for c in out["candidates"] if c["cp"] == 1)
    ranks = out["placement"]["ranks"]
    assert [r["cp_rank"] for r in ranks] == [r["rank"] % chosen["cp"] for r in ranks]
    assert main(WAN_720P) == 0
    text = capsys.readouterr().out
    assert "CP=4 splits each sample's" in text and "nothing fits at CP=1" in text


def test_cp_flag_forces_the_degree(capsys):
    out = _json(capsys, ["--model", "flux-dev", *HW, "--cp", "2"])
    assert {c["cp"] for c in out["candidates"]} == {2} and out["chosen"]["cp"] == 2
    assert "CP=2 splits each sample's 1536 tokens over 2 GPUs (the degree asked for)." in out["reason"]
    assert all(c["pp"] * c["tp"] * c["cp"] * c["dp_shard"] * c["dp_replicate"] == 8 for c in out["candidates"])


def test_cp2_prediction_matches_the_simulated_step():
    """The trainer's step at parallel.cp=2 under fake tensors against the planner's CP memory model."""
    arch = ("model.arch={num_layers: 2, num_single_layers: 3, num_attention_heads: 4, attention_head_dim: 32, "
            "axes_dims_rope: [8, 12, 12]}")
    proc = _plan_cli("--config", "yaml_configs/tiny/flux.yaml", arch, "sampler.height=128", "sampler.width=128",
                     "sampler.num_steps=5", "grpo.timestep_fraction=0.8", "parallel.cp=2", "--gpus-per-node", "2",
                     "--gpu-mem-gb", "80", "--overhead-gb", "0", "--simulate", "all", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    simulated = [c for c in json.loads(proc.stdout)["candidates"] if "simulated_peak_bytes" in c]
    assert sorted(c["schedule"] for c in simulated) == ["native", "retain", "reweight"]
    for c in simulated:
        assert c["cp"] == 2 and c["dp_shard"] * c["dp_replicate"] == 1
        assert 0.9 <= c["simulated_over_predicted"] <= 1.1, (c["schedule"], c["simulated_over_predicted"])


def test_sd3_medium_plans_with_cfg_and_the_tiny_sd3_config_simulates(capsys):
    out = _json(capsys, ["--model", "sd3.5-medium", *HW, "--resolution", "512", "--group-size", "24"])
    assert out["chosen"]["fits"] and out["world_size"] == 8
    dense = _json(capsys, ["--model", "sd3.5-medium", *HW, "--resolution", "512", "--group-size", "24",
                           "--cfg-scale", "1"])
    # CFG (SD3's default 4.5) runs [uncond; cond]: every forward costs twice the FLOPs of one without it
    assert out["chosen"]["step_time_s"] > dense["chosen"]["step_time_s"]
    proc = _plan_cli("--config", "yaml_configs/tiny/sd3.yaml", "--gpus-per-node", "2", "--gpu-mem-gb", "80",
                     "--simulate", "chosen", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    chosen = [c for c in json.loads(proc.stdout)["candidates"] if "simulated_peak_bytes" in c]
    assert len(chosen) == 1 and chosen[0]["simulated_breakdown"]["parameters"] > 0
