"""The SD3 experiment configs carry FlowGRPO's SD3.5-M settings, and the tiny SD3 config trains on the CPU."""

from pathlib import Path

from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine.model_source import check_random_init
from leangrpo_mcore.planner.layout import workload_from_config

ROOT = Path(__file__).resolve().parents[2] / "yaml_configs"


def test_flowgrpo_sd35m_is_flowgrpos_pickscore_sd3():
    config = load_config(str(ROOT / "sd3" / "flowgrpo_sd35m.yaml"))
    m, s, g = config.model, config.sampler, config.grpo
    assert (m.family, m.preset, m.lora.rank, m.lora.alpha, m.text_max_length) == ("sd3", "sd3.5-medium", 32, 64.0, 205)
    assert (s.sigma_schedule, s.shift, s.noise_level, s.cfg_scale, s.negative_prompt) == ("sd3", 3.0, 0.7, 4.5, "")
    assert (s.num_steps, config.eval.num_steps, s.height, s.width) == (10, 40, 512, 512)
    assert config.reward.name == "pickscore" and (g.kl_beta, g.global_std, g.group_size) == (0.01, True, 24)
    assert workload_from_config(config).selected_steps == 9  # the first int(10 * 0.99) steps


def test_flowgrpo_fast_sd35m_trains_the_window():
    config = load_config(str(ROOT / "sd3" / "flowgrpo_fast_sd35m.yaml"))
    s, g = config.sampler, config.grpo
    assert (s.sde_kind, s.noise_level, s.sde_window_size, s.sde_window_range) == ("flow_grpo_cps", 0.8, 3, [0, 5])
    assert (g.timestep_selection, g.clip_range, g.kl_beta, s.cfg_scale) == ("sde_window", 1e-5, 0.0, 4.5)
    assert workload_from_config(config).selected_steps == 3


def test_tiny_sd3_config_is_a_tiny_preset():
    config = load_config(str(ROOT / "tiny" / "sd3.yaml"))
    check_random_init(config)
    assert (config.model.family, config.sampler.cfg_scale) == ("sd3", 4.5)


def test_the_simulator_scales_sd3_by_block_kind():
    from leangrpo_mcore.planner.simulate import block_counts, with_blocks

    config = load_config(str(ROOT / "sd3" / "flowgrpo_sd35m.yaml"))
    assert block_counts(config) == {"dual_attention_layers": 13, "num_layers": 11}  # MMDiT-X, then plain
    smaller = with_blocks(config, {"dual_attention_layers": 3, "num_layers": 4})
    assert smaller.model.arch["num_layers"] == 7 and smaller.model.arch["dual_attention_layers"] == [0, 1, 2]
    assert block_counts(smaller) == {"dual_attention_layers": 3, "num_layers": 4}
