"""The shipped experiment configs: every file loads, the paper's settings are the ones written, and a full-size
preset is never RL-trained from random weights by accident (while the planner and benchmarks keep working)."""

from pathlib import Path

import pytest

from leangrpo_mcore.cli.plan import main as plan_main
from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.model_source import check_random_init
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.layout import workload_from_config
from leangrpo_mcore.planner.simulate import block_counts

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "yaml_configs").rglob("*.yaml"))
FLUX = ROOT / "yaml_configs" / "flux_dev"
WAN = ROOT / "yaml_configs" / "wan" / "dancegrpo_wan21_1.3b.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "yaml_configs")))
def test_every_shipped_config_loads(path):
    config = load_config(str(path))
    assert config.sampler.num_steps >= 1


def test_every_directory_is_covered():
    assert {p.parent.name for p in CONFIGS} >= {"bench", "demo", "flux_dev", "tiny", "wan"} and len(CONFIGS) >= 17


def test_flux_experiments_are_the_papers():
    for name in ("flowgrpo_lora", "flowgrpo_full", "flowgrpo_fast", "dancegrpo"):
        config = load_config(str(FLUX / f"{name}.yaml"))
        assert config.reward.name == "pickscore"
        assert config.reward.options == {"path": None, "processor_path": None, "batch_size": 16}
        assert (config.model.path, config.model.text_encoder_path, config.model.vae_path) == (None, None, None)
        assert config.model.dtype == "bfloat16" and config.model.master_dtype == "float32"
        assert config.data.prompts == "datasets/pickscore"
        e = config.eval
        assert (e.every, e.before_train, e.samples_per_prompt, e.noise_level, e.num_steps) == (50, True, 1, 0.0, 28)
    lora = load_config(str(FLUX / "flowgrpo_lora.yaml"))
    assert (lora.sampler.height, lora.sampler.width, lora.sampler.num_steps) == (512, 512, 6)
    assert int(6 * lora.grpo.timestep_fraction) == 5  # FlowGRPO's selection: the first int(T * f) steps
    assert workload_from_config(lora).selected_steps == 5
    assert (lora.model.lora.rank, lora.model.lora.alpha, lora.optim.max_grad_norm) == (64, 128.0, 1.0)
    assert load_config(str(FLUX / "flowgrpo_fast.yaml")).sampler.noise_level == 0.8


def test_mixgrpo_flash_is_the_references():
    """MixGRPO-Flash's FLUX script: 25 steps, eta 0.7, shift 3, a 4-step window moving 1 step every 20 iterations
    up to the last step MixGRPO trains (22), DPM-Solver++ order 2, 720x720, 12 generations, lr 1e-5."""
    config = load_config(str(FLUX / "mixgrpo_flash.yaml"))
    s, g = config.sampler, config.grpo
    assert (s.num_steps, s.noise_level, s.sigma_schedule, s.shift, s.sde_kind) == (25, 0.7, "dance", 3.0, "flow_grpo")
    assert (s.sde_window_size, s.sde_window_schedule, s.window_stride, s.window_shift_every) == (4, "progressive", 1, 20)
    assert s.sde_window_range[1] - 1 + s.sde_window_size - 1 == 22
    assert (s.ode_solver, s.ode_solver_before_window, s.ode_steps_after_window) == ("dpmpp_2m", "euler", 0.4)
    from leangrpo_mcore.diffusion.window import ratio_tail_steps

    assert ratio_tail_steps(25, 4, 0.4) == 7  # the reference's post-window steps at the first window: 8 points
    assert ratio_tail_steps(25, 12, 0.4) == 4 and ratio_tail_steps(25, 23, 0.4) == 1  # shrinking as it moves
    assert (s.height, s.width, s.same_latent, g.group_size, config.optim.lr) == (720, 720, True, 12, 1e-5)
    assert (g.timestep_selection, g.kl_beta, g.clip_range) == ("sde_window", 0.0, 1e-4)


def test_grpo_guard_configs_are_the_references():
    """GRPO-Guard's released SD3.5-M text-rendering setting (FlowGRPO's general_ocr_sd3_rationorm), and FLUX.1-dev's
    FlowGRPO setting with the same two parts and training shape."""
    sd3 = load_config(str(ROOT / "yaml_configs" / "sd3" / "grpo_guard_sd35m.yaml"))
    s, g = sd3.sampler, sd3.grpo
    assert (s.num_steps, s.noise_level, s.cfg_scale, s.height, s.sde_kind) == (10, 0.7, 4.5, 512, "flow_grpo")
    assert (g.group_size, g.prompts_per_step, g.updates_per_rollout) == (24, 48, 2)
    assert (g.ratio_norm, g.grad_reweight, g.clip_range, g.kl_beta, g.global_std) == (True, "flow_grpo", 2e-6, 0.0,
                                                                                        False)
    assert (sd3.model.lora.rank, sd3.model.lora.alpha, sd3.optim.lr, sd3.reward.name) == (32, 64.0, 1e-4, "ocr")
    assert workload_from_config(sd3).selected_steps == 9
    flux = load_config(str(FLUX / "grpo_guard.yaml"))
    assert (flux.grpo.ratio_norm, flux.grpo.grad_reweight, flux.grpo.updates_per_rollout) == (True, "flow_grpo", 2)
    assert (flux.sampler.num_steps, flux.sampler.noise_level, flux.model.lora.rank) == (6, 0.9, 64)


def test_wan_experiment_is_the_papers():
    config = load_config(str(WAN))
    s = config.sampler
    assert (s.height, s.width, s.frames, s.num_steps, s.cfg_scale) == (512, 512, 1, 20, 5.0)
    assert int((20 - 1) * config.grpo.timestep_fraction) == 11  # DanceGRPO's selection over the T-1 candidates
    assert workload_from_config(config).selected_steps == 11
    assert config.model.master_dtype == "float32" and config.optim.max_grad_norm == 0.1
    assert config.reward.name == "hpsv2" and config.reward.options["path"] is None
    assert config.reward.options["frames"] == "first"
    assert config.eval.every > 0 and config.eval.before_train


@pytest.mark.parametrize("path,preset,source", [(FLUX / "flowgrpo_lora.yaml", "flux-dev", "FLUX.1-dev"),
                                                (WAN, "wan2.1-1.3b", "Wan2.1-T2V-1.3B")])
def test_training_a_full_size_preset_without_weights_is_one_error_line(capsys, tmp_path, path, preset, source):
    code = train_main(["--config", str(path), f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err, err
    assert errors == [f"error: model.path is not set: preset {preset} would RL-train a randomly initialised model; "
                      f"set model.path to the {source} transformer directory (or model.random_init: true on purpose)"]


def test_random_init_on_purpose_and_tiny_presets_pass():
    config = load_config(str(FLUX / "flowgrpo_lora.yaml"), ["model.random_init=true"])
    family, hyper = build.policy_hyper(config)
    assert family.name == "flux" and hyper["num_layers"] == 19 and hyper["num_single_layers"] == 38
    for tiny in ("tiny/flux.yaml", "tiny/wan.yaml", "demo/tiny_flux_cpu.yaml"):
        check_random_init(load_config(str(ROOT / "yaml_configs" / tiny)))
    with pytest.raises(UserError, match="^model.path is not set: preset flux-dev"):
        build.policy_hyper(load_config(str(FLUX / "base.yaml")))


def test_benchmark_configs_build_without_weights():
    for path in (ROOT / "yaml_configs" / "bench").glob("*.yaml"):
        check_random_init(load_config(str(path)))  # flux_gpu.yaml: a full-size preset, random_init set


def test_the_planner_needs_no_weights(capsys):
    config = load_config(str(FLUX / "flowgrpo_lora.yaml"))
    assert block_counts(config) == {"num_layers": 19, "num_single_layers": 38}  # what --simulate scales from
    code = plan_main(["--config", str(WAN), "parallel.tp=2", "--gpus-per-node", "8", "--gpu-mem-gb", "80",
                      "--top", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "reward model CLIP ViT-H-14 on the scoring ranks" in out
