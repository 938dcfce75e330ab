"""The planner and the fake-tensor step simulator count FLUX.1-Kontext's reference tokens: they are image tokens to
every layer (the image stream doubles at the same resolution), not latents the trajectories store."""

import json
from pathlib import Path

import pytest

from leangrpo_mcore.cli.plan import main as plan_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.planner.arch_specs import load_arch
from leangrpo_mcore.planner.config_workload import tokens_of
from leangrpo_mcore.planner.simulate import simulate_step

ROOT = Path(__file__).resolve().parents[2]
HW = ["--gpus-per-node", "8", "--gpu-mem-gb", "80", "--resolution", "1024", "--group-size", "8"]


def _json(capsys, argv):
    assert plan_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _by_layout(plan: dict) -> dict:
    keys = ("schedule", "pp", "tp", "cp", "dp_shard", "dp_replicate", "activation_checkpointing", "gather_mode")
    return {tuple(c[k] for k in keys): c for c in plan["candidates"] if c["feasible"]}


def test_plan_of_flux_kontext_dev_counts_the_reference_tokens(capsys):
    assert plan_main(["--model", "flux-kontext-dev", *HW, "--top", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "8192 image/video (of which 4096 of the conditioning image) + 512 text tokens" in first
    kontext = _by_layout(_json(capsys, ["--model", "flux-kontext-dev", *HW]))
    dev = _by_layout(_json(capsys, ["--model", "flux-dev", *HW]))
    off = _by_layout(_json(capsys, ["--model", "flux-kontext-dev", "--image-conditioning", "off", *HW]))
    assert off.keys() == dev.keys() and all(off[k]["peak_mem_bytes"] == dev[k]["peak_mem_bytes"] for k in dev)
    shared = [k for k in kontext if k in dev and not k[6]]  # the same layouts, without activation checkpointing
    assert shared
    for key in shared:
        ratio = kontext[key]["details"]["activations_per_sample_bytes"] / dev[key]["details"]["activations_per_sample_bytes"]
        assert 1.6 < ratio < 2.6, (key, ratio)  # 8704 joint tokens against 4608, attention quadratic in them
        assert kontext[key]["step_time_s"] > 1.4 * dev[key]["step_time_s"]  # gathers and the optimizer do not grow


def test_a_config_with_images_plans_its_reference_tokens(capsys):
    config = str(ROOT / "yaml_configs" / "flux_kontext" / "flowgrpo_edit.yaml")
    assert plan_main(["--config", config, "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--top", "1"]) == 0
    assert "2048 image/video (of which 1024 of the conditioning image) + 512 text tokens" in capsys.readouterr().out
    cfg = load_config(config, ["data.images=false"])
    assert tokens_of(cfg, load_arch("flux-dev"))["image"] == 1024
    arch = load_arch("flux-kontext-dev")
    tokens = arch.tokens(512, 512, reference=True)
    assert arch.latent_elements(tokens) == arch.latent_elements(arch.tokens(512, 512)) == 1024 * 64
    assert arch.reference_elements(tokens) == 1024 * 64
    for preset in ("sd3.5-medium", "qwen-image"):
        with pytest.raises(ValueError, match="counts no conditioning image"):
            load_arch(preset).tokens(512, 512, reference=True)


def test_the_simulated_config_of_flux_kontext_dev_has_its_images():
    """``leangrpo-plan --model flux-kontext-dev --simulate`` simulates a config that conditions on images."""
    from leangrpo_mcore.cli.plan import build_parser, workload_from_args
    from leangrpo_mcore.planner.simulate_plan import flags_config

    args = build_parser().parse_args(["--model", "flux-kontext-dev", *HW])
    work = workload_from_args(args, 8)
    config = flags_config(work, height=1024, width=1024, frames=1, cfg_scale=1.0)
    assert config.data.images and config.model.preset == "flux-kontext-dev"
    assert tokens_of(config, work.arch, text_tokens=512) == work.tokens


@pytest.mark.slow
def test_simulated_step_holds_the_reference_tokens_activations():
    """The same tiny Retain step simulated with and without the source image: the kept graphs grow with the image
    stream (64 generated tokens, 64 reference tokens, 16 text tokens per sample)."""
    overrides = ["sampler.height=128", "sampler.width=128", "schedule.name=retain", "grpo.prompts_per_step=1"]
    cfg = load_config(str(ROOT / "yaml_configs" / "flux_kontext" / "tiny_edit.yaml"), overrides)
    kontext = simulate_step(cfg, 2, backend="gloo")
    plain = simulate_step(load_config(str(ROOT / "yaml_configs" / "flux_kontext" / "tiny_edit.yaml"),
                                      overrides + ["data.images=false"]), 2, backend="gloo")
    ratio = kontext.breakdown["retained_graphs"] / plain.breakdown["retained_graphs"]
    assert 1.4 < ratio < 2.4, ratio
    assert kontext.peak_bytes > plain.peak_bytes
