"""The planner on two experts (Wan2.2-A14B): both experts' weights, gradients and optimizer state, a frozen expert
in the compute dtype, the gathers of a step, the trained expert's steps, and the layouts the engine refuses."""

import json

import pytest

from leangrpo_mcore.config import load_config
from leangrpo_mcore.planner.arch_specs import load_arch, param_counts
from leangrpo_mcore.planner.config_workload import workload_from_config
from leangrpo_mcore.planner.cost_model import estimate
from leangrpo_mcore.planner.workload import GiB, Hardware, Layout, Workload

TINY_WAN = "yaml_configs/tiny/wan.yaml"
HW = Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=None)


def _work(name: str, **kw) -> Workload:
    arch = load_arch(name)
    return Workload(arch=arch, tokens=arch.tokens(480, 832, 33), num_steps=16, selected_steps=8, group_size=8,
                    prompts_per_step=1, cfg=True, **kw)


def _terms(work: Workload, layout: Layout, schedule: str = "native", mode: str = "forward") -> dict:
    est = estimate(work, HW, layout, schedule, ac=True)
    assert est.feasible, est.note
    return {name: value for phase in est.phases.values() for name, value in phase.items()}, est


def test_two_experts_hold_twice_one_experts_weights_and_state():
    a14b, one = load_arch("wan2.2-t2v-a14b"), load_arch("wan2.1-14b")
    assert (a14b.experts, one.experts) == (2, 1) and param_counts(a14b) == param_counts(one)
    layout = Layout(tp=1, dp_shard=8, dp_replicate=1)
    both, _ = _terms(_work("wan2.2-t2v-a14b"), layout)
    single, _ = _terms(_work("wan2.1-14b"), layout)
    for term in ("weights", "optimizer", "grads", "optimizer_temporaries"):
        assert both[term] == pytest.approx(2 * single[term], rel=1e-6), term
    high, _ = _terms(_work("wan2.2-t2v-a14b", experts_train="high"), layout)
    for term in ("optimizer", "grads"):
        assert high[term] == single[term], term
    # the frozen expert: bf16 weights (compute dtype), no master copy: 4 + 2 bytes a parameter over 4 + 4
    assert high["weights"] == pytest.approx(single["weights"] * 6 / 4, rel=1e-6)
    # Retain / coalesced Native's unsharded gradient spans the trained experts
    retain, _ = _terms(_work("wan2.2-t2v-a14b"), layout, "retain")
    retain_one, _ = _terms(_work("wan2.1-14b"), layout, "retain")
    assert retain["unsharded_grads"] == 2 * retain_one["unsharded_grads"]


def test_gathered_parameters_cover_both_experts_of_a_rollout():
    layout = Layout(tp=1, dp_shard=8, dp_replicate=1)
    for mode, ratio in ((True, 1.0), (False, 2.0)):
        both, est = _terms(_work("wan2.2-t2v-a14b", reshard_after_forward=mode), layout)
        one, est_one = _terms(_work("wan2.1-14b", reshard_after_forward=mode), layout)
        assert both["gathered_params"] == pytest.approx(ratio * one["gathered_params"]), mode
        assert est.time["fsdp_all_gather"] == pytest.approx(ratio * est_one.time["fsdp_all_gather"], rel=0.01)
        # a forward runs one expert: the compute is one expert's
        assert est.time["rollout"] == est_one.time["rollout"] and est.time["backward"] == est_one.time["backward"]


def test_ranks_running_different_experts_need_gathered_units_and_one_sync():
    layout = Layout(tp=1, dp_shard=8, dp_replicate=1)
    work = _work("wan2.2-t2v-a14b", selection="dance_grpo", reshard_after_forward=True)
    for schedule in ("native", "retain", "reweight"):
        est = estimate(work, HW, layout, schedule, ac=True)
        assert not est.feasible and "different" in est.note, schedule
    gathered = _work("wan2.2-t2v-a14b", selection="dance_grpo", reshard_after_forward=False)
    assert "coalesce" in estimate(gathered, HW, layout, "native", ac=True).note
    assert estimate(gathered, HW, layout, "retain", ac=True).feasible
    coalesced = _work("wan2.2-t2v-a14b", selection="dance_grpo", reshard_after_forward="auto", coalesce_sync=True)
    est = estimate(coalesced, HW, layout, "native", ac=True)
    assert est.feasible and est.gather_mode == "step"
    # FlowGRPO's selection trains the same steps everywhere: every rank runs the same expert
    assert estimate(_work("wan2.2-t2v-a14b", reshard_after_forward=True), HW, layout, "native", ac=True).feasible


def test_a_config_counts_the_trained_experts_steps(tmp_path):
    # tiny Wan on the DanceGRPO schedule (shift 3, T=4): timesteps 1000, 900 | 750, 500 at the 875 boundary
    base = ["model.preset=wan-tiny-a14b", "grpo.timestep_fraction=1.0"]  # every step but the last may train
    counts = {train: workload_from_config(load_config(TINY_WAN, [*base, f"model.experts.train={train}"]))
              for train in ("both", "high", "low")}
    assert {k: w.selected_steps for k, w in counts.items()} == {"both": 3, "high": 2, "low": 1}
    assert counts["high"].trained_experts == 1 and counts["both"].trained_experts == 2
    flow = workload_from_config(load_config(TINY_WAN, ["model.preset=wan-tiny-a14b", "model.experts.train=low",
                                                       "grpo.timestep_selection=flow_grpo",
                                                       "grpo.timestep_fraction=0.5"]))
    assert flow.selected_steps == 1  # steps 0-1 are selected, both high: the planner counts at least one


def test_pipeline_root_with_two_experts_is_planned_as_two(tmp_path):
    root = tmp_path / "a14b"
    for sub in ("transformer", "transformer_2"):
        (root / sub).mkdir(parents=True)
        (root / sub / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel",
                                                            "num_layers": 3, "num_attention_heads": 4}))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": 0.9, "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    arch = load_arch(str(root))
    assert arch.experts == 2 and arch.num_layers == 3 and arch.config["boundary_ratio"] == 0.9
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": None,
                                                       "transformer_2": [None, None]}))
    assert load_arch(str(root)).experts == 1


def test_plan_cli_plans_a14b_with_a_frozen_expert(capsys):
    from leangrpo_mcore.cli.plan import main

    argv = ["--model", "wan2.2-t2v-a14b", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--resolution", "480x832",
            "--frames", "33", "--num-steps", "16", "--selected-steps", "8", "--group-size", "8", "--json"]
    assert main(argv) == 0
    both = json.loads(capsys.readouterr().out)
    assert main(argv + ["--experts-train", "high"]) == 0
    high = json.loads(capsys.readouterr().out)
    assert both["chosen"]["fits"] and high["chosen"]["fits"]
    same = {(c["schedule"], c["tp"], c["cp"], c["pp"], c["dp_shard"], c["gather_mode"],
             c["activation_checkpointing"]): c for c in both["candidates"] if c["feasible"]}
    pairs = [(c, same[key]) for c in high["candidates"] if c["feasible"] and (key := (
        c["schedule"], c["tp"], c["cp"], c["pp"], c["dp_shard"], c["gather_mode"], c["activation_checkpointing"]))
        in same]
    # one expert's gradients and optimizer state fewer, the frozen one in bf16: less memory on every layout
    assert pairs and all(h["peak_mem_bytes"] < b["peak_mem_bytes"] for h, b in pairs)
    assert main(["--model", "wan2.1-14b", "--gpus-per-node", "8", "--gpu-mem-gb", "80",
                 "--experts-train", "high"]) == 2
    assert "one transformer" in capsys.readouterr().err


@pytest.mark.slow
def test_the_a14b_experiment_plans_on_8_to_64_gpus_and_needs_its_weights(capsys, tmp_path):
    from leangrpo_mcore.cli.plan import main as plan_main
    from leangrpo_mcore.cli.train import main as train_main

    path = "yaml_configs/wan/flowgrpo_wan22_a14b.yaml"
    config = load_config(path)
    work = workload_from_config(config)
    assert work.arch.experts == 2 and work.trained_experts == 2 and work.selected_steps == 8
    assert (config.model.lora.rank, config.grpo.kl_beta, config.grpo.timestep_selection) == (32, 0.004, "flow_grpo")
    for nodes in (1, 8):
        assert plan_main(["--config", path, "--nodes", str(nodes), "--gpus-per-node", "8", "--gpu-mem-gb", "80",
                          "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["chosen"]["fits"]
    # (a named schedule: with auto the planner would first find nothing fits this CPU's memory)
    assert train_main(["--config", path, "schedule.name=reweight", f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == ["error: model.path is not set: preset wan2.2-t2v-a14b would RL-train a randomly initialised "
                   "model; set model.path to the Wan2.2-T2V-A14B pipeline root (its transformer/ and transformer_2/ "
                   "are the two experts) (or model.random_init: true on purpose)"]


@pytest.mark.slow
def test_two_expert_predictions_match_the_simulated_step():
    """The trainer's two-expert step under fake tensors against the planner's prediction, within 10 %."""
    import subprocess
    import sys

    arch = "model.arch={num_layers: 2, num_attention_heads: 4, attention_head_dim: 32, ffn_dim: 256, text_dim: 64}"
    # DanceGRPO's per-sample steps on 2 ranks (the units stay gathered, Native coalesces: the config's choice),
    # the high-noise expert trained and the low-noise one frozen
    proc = subprocess.run([sys.executable, "-m", "leangrpo_mcore.cli.plan", "--config",
                           "yaml_configs/tiny/wan_a14b.yaml", arch, "sampler.height=128", "sampler.width=128",
                           "sampler.num_steps=5", "grpo.timestep_fraction=1.0", "model.experts.train=high",
                           "--gpus-per-node", "2",
                           "--gpu-mem-gb", "80", "--overhead-gb", "0", "--simulate", "all", "--json"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    simulated = [c for c in json.loads(proc.stdout)["candidates"] if "simulated_peak_bytes" in c]
    assert sorted(c["schedule"] for c in simulated) == ["native", "retain", "reweight"]
    for c in simulated:
        assert 0.9 <= c["simulated_over_predicted"] <= 1.1, (c["schedule"], c["simulated_over_predicted"])


def test_image_to_video_architectures_count_their_conditioning(capsys):
    from leangrpo_mcore.cli.plan import main as plan_main
    from leangrpo_mcore.models import build_policy
    from leangrpo_mcore.planner.arch_specs import arch_from_config, boundary_elements, forward_flops
    from leangrpo_mcore.models.wan import PRESETS

    i2v, t2v = load_arch("wan2.1-i2v-14b"), load_arch("wan2.1-14b")
    tokens, plain = i2v.tokens(480, 832, 81), t2v.tokens(480, 832, 81)
    assert tokens["clip"] == 257 and "clip" not in plain
    assert tokens["image"] == plain["image"] and i2v.latent_channels == 16
    # the CLIP tokens cost each block's queries an attention over them and the image keys and values
    assert forward_flops(i2v, tokens)["attention"] > forward_flops(t2v, plain)["attention"]
    assert boundary_elements(i2v, tokens) == boundary_elements(t2v, plain) + 257 * 5120
    tiny = arch_from_config("wan", PRESETS["wan-tiny-i2v"])
    assert param_counts(tiny)["total"] == build_policy({"family": "wan", "preset": "wan-tiny-i2v"},
                                                       backend="local").num_parameters()
    a14b = load_arch("wan2.2-i2v-a14b")
    assert a14b.experts == 2 and a14b.image_tokens == 0
    for model in ("wan2.1-i2v-14b", "wan2.2-i2v-a14b"):
        assert plan_main(["--model", model, "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--resolution", "480x832",
                          "--frames", "33", "--num-steps", "16", "--selected-steps", "8", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["chosen"]["fits"]


def test_ti2v_image_to_video_plans_the_generated_frames(capsys):
    from leangrpo_mcore.cli.plan import main as plan_main

    config = load_config("yaml_configs/wan/dancegrpo_ti2v_5b_i2v.yaml")
    work = workload_from_config(config)
    # 480x832x33 on the 16x VAE: 9 latent frames of 30 x 52 / 4 tokens; the image's frame is the reference
    assert work.tokens["image"] == 9 * 390 and work.tokens["reference"] == 390
    assert work.arch.latent_elements(work.tokens) == 8 * 390 * 4 * 48  # the trajectories store the generated frames
    assert work.arch.reference_elements(work.tokens) == 390 * 4 * 48
    argv = ["--model", "wan2.2-ti2v-5b", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--resolution", "480x832",
            "--frames", "33", "--json"]
    assert plan_main(argv + ["--image-conditioning", "on"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert plan_main(argv) == 0
    off = json.loads(capsys.readouterr().out)
    assert on["chosen"]["fits"] and off["chosen"]["fits"]
    assert plan_main(["--config", "yaml_configs/wan/dancegrpo_ti2v_5b_i2v.yaml", "--gpus-per-node", "8",
                      "--gpu-mem-gb", "80", "--top", "2"]) == 0
    assert "(of which 390 of the conditioning image)" in capsys.readouterr().out
