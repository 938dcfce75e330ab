"""The planner charges the learned reward model to the scoring ranks only: its parameters in its dtype plus one
scoring batch's activations, from the CLIP architectures the rewards load."""

from pathlib import Path

import pytest

from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.layout import plan, predict_memory, workload_from_config
from leangrpo_mcore.planner.reward_specs import AESTHETIC, VIT_H_14, VIT_L_14, reward_memory
from leangrpo_mcore.planner.workload import Hardware

ROOT = Path(__file__).resolve().parents[2]
FLOWGRPO_LORA = str(ROOT / "yaml_configs" / "flux_dev" / "flowgrpo_lora.yaml")
JPEG = ["reward.name=jpeg_compressibility", "reward.options={}"]

VIT_H_PARAMS = 986_109_441  # transformers CLIPModel of CLIP-ViT-H-14-laion2B (PickScore_v1, HPSv2.1)
VIT_L_PARAMS = 427_616_513  # transformers CLIPModel of openai/clip-vit-large-patch14
AESTHETIC_MLP = 768 * 1024 + 1024 + 1024 * 128 + 128 + 128 * 64 + 64 + 64 * 16 + 16 + 16 * 1 + 1


def _vit_h_activations(batch: int, dtype_bytes: int) -> int:
    """The widest block of ViT-H-14's vision tower: 257 tokens, residual + LayerNorm output (2 x 1280) held
    while fc1's output and its GELU (2 x 5120) exist."""
    return batch * 257 * (2 * 1280 + 2 * 5120) * dtype_bytes


def _meta_clip_params(vision: tuple, text: tuple, projection_dim: int) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    layers, width, mlp, heads = vision
    t_layers, t_width, t_mlp, t_heads = text
    config = transformers.CLIPConfig(
        vision_config={"num_hidden_layers": layers, "hidden_size": width, "intermediate_size": mlp,
                       "num_attention_heads": heads, "patch_size": 14, "image_size": 224},
        text_config={"num_hidden_layers": t_layers, "hidden_size": t_width, "intermediate_size": t_mlp,
                     "num_attention_heads": t_heads, "vocab_size": 49408, "max_position_embeddings": 77},
        projection_dim=projection_dim)
    with torch.device("meta"):
        model = transformers.CLIPModel(config)
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts_match_transformers_clip_models():
    assert VIT_H_14.params == VIT_H_PARAMS == _meta_clip_params((32, 1280, 5120, 16), (24, 1024, 4096, 16), 1024)
    assert VIT_L_14.params == VIT_L_PARAMS == _meta_clip_params((24, 1024, 4096, 16), (12, 768, 3072, 12), 768)
    assert AESTHETIC.params == VIT_L_PARAMS + AESTHETIC_MLP and AESTHETIC_MLP == 927_969


def test_reward_memory_of_each_reward_and_option():
    config = load_config(FLOWGRPO_LORA)
    assert reward_memory(config.reward).weights_bytes == 2 * VIT_H_PARAMS  # bf16 by default
    assert reward_memory(config.reward).activation_bytes == _vit_h_activations(16, 2)
    fp32 = load_config(FLOWGRPO_LORA, ["reward.options.dtype=float32", "reward.options.batch_size=4"]).reward
    assert reward_memory(fp32).weights_bytes == 4 * VIT_H_PARAMS
    assert reward_memory(fp32).activation_bytes == _vit_h_activations(4, 4)
    clip = load_config(FLOWGRPO_LORA, ["reward.name=clip_score"]).reward
    # ViT-L/14's widest block: 257 vision tokens x (2 x 1024 + 2 x 4096), wider than the text tower's 77 x (2 x 768
    # + 2 x 3072)
    assert reward_memory(clip).activation_bytes == 16 * 257 * (2 * 1024 + 2 * 4096) * 2
    weighted = load_config(FLOWGRPO_LORA, [
        "reward.name=weighted", "reward.options={}", "reward.weights={pickscore: 1.0, aesthetic: 0.5}",
        "reward.options.reward_options={aesthetic: {batch_size: 64}}"]).reward
    both = reward_memory(weighted)
    assert both.weights_bytes == 2 * (VIT_H_PARAMS + VIT_L_PARAMS + AESTHETIC_MLP)
    # scored one after the other: the larger of the two batches' activations
    assert both.activation_bytes == max(_vit_h_activations(16, 2), 64 * 257 * (2 * 1024 + 2 * 4096) * 2)
    for name in ("jpeg_compressibility", "ocr", "remote"):
        held = reward_memory(load_config(FLOWGRPO_LORA, [f"reward.name={name}", "reward.options={}"]).reward)
        assert (held.weights_bytes, held.activation_bytes) == (0, 0)
    with pytest.raises(UserError, match=r"^reward.options.dtype: unknown dtype 'int8'"):
        reward_memory(load_config(FLOWGRPO_LORA, ["reward.options.dtype=int8"]).reward)


def _candidates(overrides: list[str]) -> dict:
    work = workload_from_config(load_config(FLOWGRPO_LORA, overrides))
    result = plan(work, Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=80 * 1024 ** 3), tp=1, cp=1, pp=1)
    return {(c.schedule, c.layout, c.activation_checkpointing): c for c in result.candidates if c.feasible}


def test_pickscore_plan_peaks_exactly_the_reward_term_above_jpeg():
    weights, acts = 2 * VIT_H_PARAMS, _vit_h_activations(16, 2)
    pick, jpeg = _candidates([]), _candidates(JPEG)
    assert pick.keys() == jpeg.keys() and len(pick) > 6
    for key, with_reward in pick.items():
        without = jpeg[key]
        for phase, terms in with_reward.phases.items():
            extra = weights + (acts if phase == "reward" else 0)  # the model always, its activations while scoring
            assert sum(terms.values()) - sum(without.phases[phase].values()) == extra, (key, phase)
        expected = max(sum(t.values()) + weights + (acts if p == "reward" else 0) for p, t in without.phases.items())
        assert with_reward.peak_mem_bytes == expected
        assert with_reward.memory["reward_model"] == weights


def test_only_the_last_pipeline_stage_holds_the_reward_model():
    weights, acts = 2 * VIT_H_PARAMS, _vit_h_activations(16, 2)
    pp = ["parallel.pp=2"]
    for stage in (0, 1):
        pick = predict_memory(load_config(FLOWGRPO_LORA, pp), world_size=8, stage=stage)
        jpeg = predict_memory(load_config(FLOWGRPO_LORA, [*pp, *JPEG]), world_size=8, stage=stage)
        for schedule, est in pick.items():
            for phase, terms in est.phases.items():
                extra = 0 if stage == 0 else weights + (acts if phase == "reward" else 0)
                assert sum(terms.values()) - sum(jpeg[schedule].phases[phase].values()) == extra, (stage, phase)


def test_simulation_adds_the_resident_reward_model_as_predicted(monkeypatch):
    from leangrpo_mcore.planner import simulate as sim_module
    from leangrpo_mcore.planner.simulate import Simulation
    from leangrpo_mcore.planner.simulate_plan import simulate_candidate

    config = load_config(FLOWGRPO_LORA)
    result = plan(workload_from_config(config), Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=80 * 1024 ** 3),
                  tp=1, cp=1, pp=1)
    monkeypatch.setattr(sim_module, "simulate", lambda *args, **kwargs: Simulation(
        peak_bytes=10 * 1024 ** 3, step_peak_bytes=0, breakdown={"parameters": 10 * 1024 ** 3}, seconds=0.0,
        fake_reads=0))
    out = simulate_candidate(config, result.chosen, result)
    reserved = int(1.5 * 1024 ** 3) + 2 * VIT_H_PARAMS  # the default --overhead-gb and the bf16 reward model
    assert out["simulated_breakdown"]["reserved"] == reserved
    assert out["simulated_peak_bytes"] == 10 * 1024 ** 3 + reserved
