"""The Qwen-Image experiment configs carry verl-omni's published FlowGRPO-OCR setting (LoRA and the non-CFG full
fine-tune), the tiny config trains on the CPU, the GPU bench config is the OCR rollout at full size, and
leangrpo-plan finds a layout for both experiments on 8 to 64 GPUs of 80 GB."""

import json
from pathlib import Path

import pytest

from leangrpo_mcore.cli.plan import main as plan_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine.model_source import check_random_init
from leangrpo_mcore.planner.layout import workload_from_config
from leangrpo_mcore.planner.simulate import block_counts

ROOT = Path(__file__).resolve().parents[2] / "yaml_configs"
OCR = ROOT / "qwen_image" / "flowgrpo_ocr.yaml"
FULL = ROOT / "qwen_image" / "flowgrpo_ocr_full.yaml"


def test_flowgrpo_ocr_is_verl_omnis_lora_setting():
    config = load_config(str(OCR))
    m, s, g = config.model, config.sampler, config.grpo
    assert (m.family, m.preset, m.lora.rank, m.lora.alpha, m.lora.targets, m.text_max_length) == (
        "qwen_image", "qwen-image", 64, 128.0, None, 256)
    assert (s.sigma_schedule, s.sde_kind, s.noise_level, s.num_steps, s.height, s.width) == (
        "qwen_image", "flow_grpo", 1.2, 10, 512, 512)
    assert (s.sde_window_size, s.sde_window_range, s.sde_window_schedule) == (2, [0, 5], "random")
    assert (s.cfg_scale, s.negative_prompt) == (4.0, " ")
    assert (g.prompts_per_step * g.group_size, g.timestep_selection, g.clip_range, g.kl_beta) == (
        512, "sde_window", 1e-4, 0.0)
    assert (config.optim.lr, config.optim.weight_decay, config.reward.name) == (3e-4, 1e-4, "ocr")
    assert (config.eval.num_steps, config.eval.noise_level) == (50, 0.0)
    assert workload_from_config(config).selected_steps == 2
    assert block_counts(config) == {"num_layers": 60}


def test_the_full_finetune_is_the_non_cfg_row():
    config = load_config(str(FULL))
    assert (config.model.lora.rank, config.sampler.cfg_scale, config.optim.lr, config.grpo.clip_range) == (
        0, 1.0, 3e-5, 1e-5)
    assert (config.schedule.name, config.parallel.tp, config.model.activation_checkpointing) == ("auto", 2, "auto")
    assert config.grpo.prompts_per_step * config.grpo.group_size == 512 and config.model.master_dtype == "float32"


def test_tiny_and_bench_configs():
    tiny = load_config(str(ROOT / "tiny" / "qwen_image.yaml"))
    check_random_init(tiny)
    assert (tiny.model.family, tiny.sampler.cfg_scale, tiny.sampler.sigma_schedule) == ("qwen_image", 4.0, "qwen_image")
    gpu = load_config(str(ROOT / "bench" / "qwen_image_gpu.yaml"))
    check_random_init(gpu)  # random weights on purpose: a timing benchmark
    ocr = load_config(str(OCR))
    for section in ("sampler",):
        assert getattr(gpu, section) == getattr(ocr, section)
    assert (gpu.model.preset, gpu.model.lora.rank, gpu.grpo.group_size) == ("qwen-image", 64, 16)


@pytest.mark.parametrize("path", [OCR, FULL], ids=["lora", "full"])
def test_leangrpo_plan_fits_the_experiments_on_8_to_64_gpus(capsys, path):
    for nodes in (1, 2, 4, 8):
        code = plan_main(["--config", str(path), "--schedule", "config", "--nodes", str(nodes), "--gpus-per-node", "8",
                          "--gpu-mem-gb", "80", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["chosen"]["fits"], (nodes, out["reason"])
        assert out["chosen"]["peak_mem_bytes"] <= 80 * 2 ** 30
