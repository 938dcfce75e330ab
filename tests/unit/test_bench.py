"""The benchmark tool: statistics, phase split, ideal ratio, state restore, forward probe, and one real run."""

import contextlib
import json
import math

import time

import pytest
import torch
from PIL import Image

from leangrpo_mcore.bench.probe import ForwardProbe, TrainingSnapshot
from leangrpo_mcore.bench.report import (PHASES, StepSample, finish_report, glance_table, ideal_ratio, ideal_sources,
                                         split_phases, spread, sweep_markdown)
from leangrpo_mcore.bench.probe import ForwardTally
from leangrpo_mcore.bench.runner import BenchOptions, parse_schedules
from leangrpo_mcore.cli.bench import main

SMOKE = "yaml_configs/bench/smoke.yaml"


def test_ideal_ratio_is_the_forward_backward_cost_ratio():
    # FlowGRPO FLUX: T=6, |S|=5, B = 2F -> (6 + 5*3) / (6 + 5*2) = 21/16.
    assert ideal_ratio(6, 5, 1.0, 2.0) == pytest.approx(21 / 16)
    assert ideal_ratio(16, 15, 0.5, 1.5) == pytest.approx((8 + 15 * 2.0) / (8 + 15 * 1.5))


def test_spread_median_quartiles_and_extremes():
    s = spread([4.0, 1.0, 3.0, 2.0])
    assert (s["median"], s["q1"], s["q3"], s["min"], s["max"], s["mean"]) == (2.5, 1.75, 3.25, 1.0, 4.0, 2.5)
    assert spread([7.0]) == {"median": 7.0, "q1": 7.0, "q3": 7.0, "min": 7.0, "max": 7.0, "mean": 7.0}
    with pytest.raises(ValueError, match="no measured steps"):
        spread([])


def test_split_phases_sums_to_the_wall_time():
    tally = ForwardTally()
    tally.seconds.update(nograd=1.0, rollout_grad=0.5)
    timings = {"rollout": 2.0, "reward": 0.25, "advantage": 0.05, "backward": 1.5, "sync": 0.1, "clip": 0.02,
               "optimizer": 0.08}
    phases = split_phases(4.5, timings, tally)
    assert list(phases) == list(PHASES)
    assert phases["reward"] == pytest.approx(0.3) and phases["optimizer"] == pytest.approx(0.1)
    # other = the rollout's non-forward 0.5 s + 0.5 s outside every timed phase.
    assert phases["other"] == pytest.approx(1.0)
    assert sum(phases.values()) == pytest.approx(4.5)


def test_pipeline_bubble_is_its_own_phase_and_leaves_the_forward_tally():
    from types import SimpleNamespace

    class Waiting:
        """A velocity function whose call spends 0.05 s waiting for another stage (as StageLink counts it)."""

        link = SimpleNamespace(waited=0.0)

        def __call__(self, latents, sigma, conditioning):
            time.sleep(0.06)
            self.link.waited += 0.05
            return latents

    probe = ForwardProbe(Waiting(), torch.device("cpu"))
    probe.begin_step(recompute_free=False)
    with torch.no_grad():
        probe(torch.zeros(2, 3), torch.zeros(2), None)
    assert 0.005 <= probe.tally.seconds["nograd"] < 0.05  # the 0.05 s wait is not forward time
    phases = split_phases(1.0, {"bubble": 0.25, "recompute": 0.25}, probe.tally)
    assert phases["bubble"] == 0.25 and sum(phases.values()) == pytest.approx(1.0)


def test_parse_schedules_and_options_reject_bad_input():
    assert parse_schedules("native, retain,reweight") == ["native", "retain", "reweight"]
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        parse_schedules("native,fast")
    with pytest.raises(ValueError, match="twice"):
        parse_schedules("native,native")
    with pytest.raises(ValueError, match="--steps"):
        BenchOptions(steps=0)
    with pytest.raises(ValueError, match="include native"):
        BenchOptions(schedules=("retain",), check_parity=True)


def _sample(seconds, backward, nograd_rows, grad_rows, recompute_rows, forward_s):
    phases = {p: 0.0 for p in PHASES}
    phases["backward"], phases["other"] = backward, seconds - backward
    return StepSample(seconds=seconds, phases=phases,
                      forward_seconds={"nograd": forward_s, "rollout_grad": 0.0, "recompute": forward_s / 2},
                      forward_rows={"nograd": nograd_rows, "rollout_grad": grad_rows, "recompute": recompute_rows})


def test_finish_report_speedups_and_ideal_sources():
    # 2 samples, T = 4, |S| = 2: Native does 8 no-grad + 4 recompute forwards; Retain's backward gives B at DP 2.
    samples = {"native": [_sample(s, 2.0, 8, 0, 4, 1.2) for s in (10.0, 12.0, 11.0)],
               "retain": [_sample(s, 1.0, 4, 4, 0, 0.8) for s in (8.0, 9.0)]}
    report = finish_report({"meta": {"dp_size": 2}, "shape": {"num_steps": 4, "steps_per_sample": 2}}, samples)
    ideal = report["ideal"]
    assert (ideal["forward_source"], ideal["backward_source"]) == ("native", "retain")
    assert ideal["forward_s"] == pytest.approx(1.8 / 12)
    assert ideal["backward_s"] == pytest.approx(1.0 / 4)
    assert ideal["ratio"] == pytest.approx(ideal_ratio(4, 2, 1.8 / 12, 0.25))
    assert report["schedules"]["retain"]["speedup"] == pytest.approx(11.0 / 8.5)
    assert report["schedules"]["retain"]["fraction_of_ideal"] == pytest.approx(11.0 / 8.5 / ideal["ratio"])
    assert report["baselines"] == {"best": "native", "fsdp": "native", "medians_s": {"native": 11.0}}
    assert report["schedules"]["retain"]["speedup_vs_best"] == pytest.approx(11.0 / 8.5)
    assert ideal_sources(["native", "retain"], 1) == ("native", "native")
    assert ideal_sources(["reweight", "native_coalesced", "native"], 4) == ("native", "native_coalesced")


def test_best_native_over_layouts_and_throughput():
    # The config's layout is replicated: FSDP2 Native is native@sharded; the fastest Native is the coalesced one.
    samples = {"native": [_sample(s, 2.0, 8, 0, 4, 1.2) for s in (10.0, 10.0)],
               "native_coalesced": [_sample(s, 2.0, 8, 0, 4, 1.2) for s in (9.0, 9.0)],
               "native@sharded": [_sample(s, 2.0, 8, 0, 4, 1.2) for s in (12.0, 12.0)],
               "reweight": [_sample(s, 1.0, 4, 4, 0, 0.8) for s in (6.0, 6.0)]}
    counts = {"reweight": {"samples_per_step": 8, "devices": 2, "flops_per_step": 3e12, "peak_tflops": 0.5,
                           "passes_per_rank": {}}}
    meta = {"dp_size": 2, "layout": "replicated", "title": "t", "world_size": 2}
    report = finish_report({"meta": meta, "shape": {"num_steps": 4, "steps_per_sample": 2}}, samples, counts)
    assert (report["baselines"]["best"], report["baselines"]["fsdp"]) == ("native_coalesced", "native@sharded")
    entry = report["schedules"]["reweight"]
    assert (entry["speedup"], entry["speedup_vs_best"], entry["speedup_vs_fsdp"]) == pytest.approx((10 / 6, 1.5, 2.0))
    assert entry["fraction_of_ideal_vs_best"] == pytest.approx(1.5 / report["ideal"]["ratio"])
    rate = entry["throughput"]
    assert (rate["samples_per_s"], rate["samples_per_s_per_device"]) == pytest.approx((8 / 6, 4 / 6))
    assert (rate["tflops_per_device"], rate["mfu"]) == pytest.approx((0.25, 0.5))
    assert report["schedules"]["native"]["throughput"] == {}
    report["meta"]["layouts"] = {"native": "replicated", "native_coalesced": "replicated",
                                 "native@sharded": "sharded", "reweight": "replicated"}
    head, _, row = glance_table(report, "FLUX")
    assert head == ("| run | ws | ideal | best Native | best Native (s) | reweight vs best | FSDP2 Native (s) "
                    "| peak MiB native@sharded |")
    ratio = report["ideal"]["ratio"]
    assert row == f"| FLUX | 2 | {ratio:.3f} | native_coalesced | 9.000 | 1.50× ({1.5 / ratio:.2f}) | 12.000 | – |"


def test_sweep_markdown_has_one_row_per_value():
    run = {"shape": {"num_steps": 6, "steps_per_sample": 5, "tokens": 256}, "ideal": {"ratio": 1.3},
           "baselines": {"best": "native_coalesced"},
           "schedules": {"native": {"step_time_s": {"median": 2.0}, "speedup": 1.0, "peak_memory_bytes": 2**20},
                         "native_coalesced": {"step_time_s": {"median": 1.8}, "speedup": 2 / 1.8,
                                              "peak_memory_bytes": 2**21},
                         "reweight": {"step_time_s": {"median": 1.6}, "speedup": 1.25, "cpu_speedup": 1.3,
                                      "speedup_vs_best": 1.125, "peak_memory_bytes": None}}}
    text = sweep_markdown({"sweep": {"key": "sampler.height", "values": ["128", "256"]}, "runs": [run, run]})
    rows = text.strip().splitlines()
    assert len(rows) == 4
    assert rows[2] == ("| 128 | 6 | 5 | 256 | 1.300 | native_coalesced | 2.000 | 1.800 | 1.600 | 1.12× | 1.25× "
                       "| 1.30× | 1.0 | 2.0 | – |")


def test_snapshot_restores_weights_and_optimizer_state_in_place():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)
    start = [p.detach().clone() for p in params]
    snapshot = TrainingSnapshot.primed(params, optimizer)
    # Priming creates the optimizer state without moving the weights.
    assert all(torch.equal(p, s) for p, s in zip(params, start)) and len(optimizer.state) == 2
    primed_step = optimizer.state[params[0]]["step"].clone()
    exp_avg = optimizer.state[params[0]]["exp_avg"]
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    assert not torch.equal(params[0], start[0]) and exp_avg.abs().sum() > 0
    snapshot.restore()
    assert all(torch.equal(p, s) and p.grad is None for p, s in zip(params, start))
    assert optimizer.state[params[0]]["exp_avg"] is exp_avg and exp_avg.abs().sum() == 0
    assert torch.equal(optimizer.state[params[0]]["step"], primed_step)


class _Velocity:
    def __init__(self):
        self.in_reference = False

    def __call__(self, latents, sigma, conditioning):
        return latents * 2

    @contextlib.contextmanager
    def reference(self):
        self.in_reference = True
        yield
        self.in_reference = False


def test_forward_probe_sorts_forwards_by_kind():
    probe = ForwardProbe(_Velocity(), torch.device("cpu"))
    x = torch.ones(3, 2)
    probe.begin_step(recompute_free=True)
    with torch.no_grad():
        probe(x, None, None)
    with torch.enable_grad():
        probe(x, None, None)
        with probe.reference():
            assert probe.in_reference
            probe(x, None, None)
        probe.after_optimizer_step()
        probe(x, None, None)
    assert probe.tally.rows == {"nograd": 3, "rollout_grad": 3, "recompute": 3, "reference": 3}
    probe.begin_step(recompute_free=False)
    with torch.enable_grad():
        probe(x[:1], None, None)
    assert probe.tally.rows == {"nograd": 0, "rollout_grad": 0, "recompute": 1, "reference": 0}


def test_cli_rejects_bad_arguments(capsys):
    assert main(["--config", SMOKE, "--schedules", "native,turbo"]) == 2
    assert "unknown schedule 'turbo'" in capsys.readouterr().err
    assert main(["--config", SMOKE, "--sweep", "sampler.height"]) == 2
    assert "--sweep takes KEY=V1,V2" in capsys.readouterr().err


def test_one_warmup_one_step_run_is_consistent(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["--config", SMOKE, "--steps", "1", "--warmup", "1", "--check-parity", "--json", f"{out}.json",
                 "--markdown", f"{out}.md", "--plot", f"{out}.png"])
    assert code == 0
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["sweep"] is None and len(document["runs"]) == 1
    run = document["runs"][0]
    shape, ideal, schedules = run["shape"], run["ideal"], run["schedules"]
    t, s, n = shape["num_steps"], shape["steps_per_sample"], shape["samples_per_rank"]
    assert (t, s, n, shape["tokens"]) == (3, 2, 2, 4) and run["meta"]["order"] == ["native", "retain", "reweight"]
    # One rank: no other layout or sync to try, Native is the best and the FSDP2 Native at once.
    assert set(run["meta"]["layouts"].values()) == {"single"}
    assert (run["baselines"]["best"], run["baselines"]["fsdp"]) == ("native", "native")
    native = schedules["native"]["step_time_s"]["median"]
    for entry in schedules.values():
        step = entry["steps"][0]
        assert len(entry["steps"]) == 1 and entry["step_time_s"]["median"] == step["time_s"]
        # The engine's timed phases and the measured forwards never exceed the step's wall time ...
        assert all(step["phases_s"][p] >= -1e-6 for p in PHASES), step["phases_s"]
        # ... and together with the untimed rest they add up to it.
        assert sum(step["phases_s"].values()) == pytest.approx(step["time_s"], rel=1e-9)
        assert sum(entry["phases_s"].values()) == pytest.approx(entry["step_time_s"]["mean"], rel=1e-9)
        assert entry["speedup"] == pytest.approx(native / entry["step_time_s"]["median"])
        assert entry["fraction_of_ideal"] == pytest.approx(entry["speedup"] / ideal["ratio"])
        cpu = entry["cpu_time_s"]["median"]
        assert 0 < cpu and entry["cpu_speedup"] == pytest.approx(schedules["native"]["cpu_time_s"]["median"] / cpu)
        assert entry["peak_memory_bytes"] > 0
    rows = {name: e["steps"][0]["forward_rows"] for name, e in schedules.items()}
    assert rows["native"] == {"nograd": n * t, "rollout_grad": 0, "recompute": n * s, "reference": 0}
    for lean in ("retain", "reweight"):
        assert rows[lean] == {"nograd": n * (t - s), "rollout_grad": n * s, "recompute": 0, "reference": 0}
        assert schedules[lean]["steps"][0]["phases_s"]["recompute"] == 0.0
    assert schedules["reweight"]["local_grad_buffers"] >= 1 and schedules["native"]["local_grad_buffers"] == 0
    native_steps = schedules["native"]["steps"]
    forward = sum(st["forward_s"][k] for st in native_steps for k in ("nograd", "recompute")) / (n * (t + s))
    assert ideal["forward_s"] == pytest.approx(forward)
    assert ideal["ratio"] == pytest.approx(ideal_ratio(t, s, ideal["forward_s"], ideal["backward_s"]))
    assert 1.0 < ideal["ratio"] < 1.0 + t / s
    assert shape["rollout_steps"] == t
    for name, entry in schedules.items():
        # The planner's prediction of the label's step, on the CPU rates, with the rollout's forwards.
        predicted = entry["predicted"]
        assert predicted["hardware"] == "cpu" and predicted["rollout_forwards"] == t
        assert predicted["step_time_s"] == pytest.approx(sum(predicted["terms_s"].values())) and predicted["step_time_s"] > 0
        # The planner's FLOP count of the step counts the forwards the step ran, by kind.
        rate = entry["throughput"]
        assert {k: v for k, v in rate["passes_per_rank"].items() if k != "backward"} == rows[name]
        assert rate["samples_per_s"] == pytest.approx(n / entry["step_time_s"]["median"])
        seconds = entry["step_time_s"]["median"]
        assert rate["tflops_per_device"] == pytest.approx(rate["flops_per_step"] / seconds / 1e12)
        assert rate["mfu"] is None  # CPU, no logging.peak_tflops
    parity = run["parity"]
    assert parity["retain"]["cosine"] > 1 - 1e-9 and parity["retain"]["rel_l2"] < 1e-6
    assert parity["reweight"]["cosine"] > 1 - 1e-6 and parity["reweight"]["rel_l2"] < 1e-4
    assert parity["retain"]["reward_max_abs_diff"] == 0.0
    markdown = (tmp_path / "bench.md").read_text()
    assert "| retain |" in markdown and "Ideal ratio" in markdown and markdown in capsys.readouterr().out
    with Image.open(tmp_path / "bench.png") as image:
        assert image.format == "PNG" and image.width > 300 and image.height > 300
    assert math.isfinite(ideal["backward_s"]) and ideal["backward_s"] > 0


def test_a_compressed_rollout_is_benched_and_predicted_with_its_forwards(tmp_path):
    """MixGRPO-Flash's sampler (a fixed window at step 1 of 6, Euler before it, 2M over a 0.4 tail after it): the
    rollout runs T' = 3 forwards, and the shape, the ideal ratio, the FLOP count and the prediction count them."""
    out = tmp_path / "mix.json"
    assert main(["--config", SMOKE, "--schedules", "retain", "--no-baselines", "--no-memory", "--steps", "1",
                 "--warmup", "0", "--json", str(out), "sampler.num_steps=6", "sampler.sde_window_size=1",
                 "sampler.sde_window_range=[1, 2]", "sampler.sde_window_schedule=fixed", "sampler.ode_solver=dpmpp_2m",
                 "sampler.ode_solver_before_window=euler", "sampler.ode_steps_after_window=0.4",
                 "grpo.timestep_selection=sde_window", "grpo.timestep_fraction=1.0"]) == 0
    run = json.loads(out.read_text())["runs"][0]
    entry, n = run["schedules"]["retain"], run["shape"]["samples_per_rank"]
    assert (run["shape"]["num_steps"], run["shape"]["rollout_steps"]) == (6, 3)  # 2 steps to the window's end, 1 after
    assert entry["steps"][0]["forward_rows"] == {"nograd": n * 2, "rollout_grad": n, "recompute": 0, "reference": 0}
    assert entry["throughput"]["passes_per_rank"]["nograd"] == n * 2
    assert entry["predicted"]["rollout_forwards"] == 3
    forward, backward = run["ideal"]["forward_s"], run["ideal"]["backward_s"]
    assert run["ideal"]["ratio"] == pytest.approx(ideal_ratio(3, 1, forward, backward))
