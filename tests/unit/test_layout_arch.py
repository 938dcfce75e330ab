"""Architecture arithmetic of the planner: parameter counts, tokens, FLOPs, LoRA sizes, activation fit."""

import importlib.util
import os
import warnings

import pytest

from tests.once import once_per_process
import torch

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner import activations as act
from leangrpo_mcore.planner.arch_specs import (
    BUILTIN_PRESETS,
    DEFAULT_LORA_TARGETS,
    arch_from_config,
    forward_flops,
    load_arch,
    lora_params,
    param_counts,
    params_per_rank,
)

# Parameter counts of diffusers' FluxTransformer2DModel / WanTransformer3DModel built on the meta device from the
# published config.json files (diffusers 0.42.1), and the sizes the model names advertise.
# A two-expert preset counts one expert (param_counts; each of transformer/ and transformer_2/).
DIFFUSERS_COUNTS = {"flux-dev": 11_901_408_320, "wan2.1-1.3b": 1_418_996_800, "wan2.1-14b": 14_288_491_584,
                    "wan2.2-t2v-a14b": 14_288_491_584, "wan2.1-i2v-14b": 16_394_878_784,
                    "wan2.2-i2v-a14b": 14_288_901_184,
                    "wan2.2-ti2v-5b": 4_999_787_712, "sd3.5-medium": 2_243_171_520, "sd3.5-large": 8_056_627_520,
                    "flux-kontext-dev": 11_901_408_320,  # FLUX.1-Kontext-dev: FLUX.1-dev's transformer
                    "qwen-image": 20_430_401_088}
# (SD3.5-M's advertised 2.5B counts its 0.23B positional table, a buffer: not listed.)
PUBLISHED = {"flux-dev": 12e9, "wan2.1-14b": 14e9, "wan2.2-ti2v-5b": 5e9, "sd3.5-large": 8.1e9, "qwen-image": 20e9}


@pytest.mark.parametrize("name", sorted(BUILTIN_PRESETS))
def test_builtin_parameter_counts_match_diffusers(name):
    counts = param_counts(load_arch(name))
    assert counts["total"] == DIFFUSERS_COUNTS[name]
    assert counts["tp_sharded"] + counts["replicated"] == counts["total"]


def test_published_sizes_within_a_few_percent():
    for name, size in PUBLISHED.items():
        assert abs(param_counts(load_arch(name))["total"] / size - 1) < 0.03, name
    # "1.3B" rounds the real 1.419e9 parameters down (9 %): the arithmetic follows the weights, not the name.
    assert abs(param_counts(load_arch("wan2.1-1.3b"))["total"] / 1.419e9 - 1) < 1e-3


@pytest.fixture(scope="module")
@once_per_process
def tiny_policies():
    from leangrpo_mcore.models import apply_lora, build_policy, get_family, lora_parameters
    from leangrpo_mcore.models.common.lora import LoRAConfig

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family, preset in (("flux", "flux-tiny"), ("wan", "tiny"), ("sd3", "sd3-tiny"),
                               ("qwen_image", "qwen-image-tiny")):
            fam = get_family(family)
            model = build_policy({"family": family, "preset": preset}, backend="local")
            full = sum(p.numel() for p in model.parameters())
            split = sum(p.numel() for name, mod in model.named_modules() if getattr(mod, "parallel_mode", "")
                        in ("column", "row") for pname, p in mod.named_parameters(recurse=False)
                        if pname == "weight" or getattr(mod, "parallel_mode") == "column")
            apply_lora(model, LoRAConfig(rank=4, alpha=4.0, targets=fam.lora_targets))
            out[family] = (fam, preset, full, split, sum(p.numel() for p in lora_parameters(model)))
    return out


@pytest.mark.parametrize("family", ["flux", "sd3", "wan", "qwen_image"])
def test_tiny_presets_match_built_policies_exactly(tiny_policies, family):
    fam, preset, full, split, lora = tiny_policies[family]
    arch = arch_from_config(family, fam.presets[preset])
    counts = param_counts(arch)
    assert counts["total"] == full
    # TP-sharded linear parameters (weights of column/row layers, biases of column layers); Wan's q/k norms
    # across heads are sharded too and are not linears.
    norms = arch.blocks[0].tp_norm_params * arch.blocks[0].count
    assert counts["tp_sharded"] - norms == split
    assert lora_params(arch, 4, fam.lora_targets)["total"] == lora
    assert DEFAULT_LORA_TARGETS[family] == tuple(fam.lora_targets)


@pytest.mark.parametrize("name", sorted(BUILTIN_PRESETS))
def test_builtin_presets_agree_with_the_models_package(name):
    from leangrpo_mcore.models import get_family

    family = BUILTIN_PRESETS[name][0]
    ours, theirs = load_arch(name), arch_from_config(family, get_family(family).presets[name])
    assert param_counts(ours) == param_counts(theirs)
    frames = 1 if family in ("flux", "sd3", "qwen_image") else 81
    assert ours.tokens(704, 1280, frames) == theirs.tokens(704, 1280, frames)


def test_token_counts():
    assert load_arch("flux-dev").tokens(512, 512)["image"] == 1024
    assert load_arch("flux-dev").tokens(720, 720, text_tokens=256) == {"image": 2025, "text": 256, "joint": 2281,
                                                                        "sample": 1}
    assert load_arch("wan2.1-1.3b").tokens(480, 832, 81)["image"] == 21 * 30 * 52  # 32760
    assert load_arch("wan2.2-ti2v-5b").tokens(704, 1280, 121)["image"] == 31 * 22 * 40  # VAE stride (4, 16, 16)
    with pytest.raises(UserError, match="multiples of 16"):
        load_arch("flux-dev").tokens(500, 512)
    with pytest.raises(UserError, match="frames must be 1"):
        load_arch("flux-dev").tokens(512, 512, 5)
    with pytest.raises(UserError, match="1 \\+ a multiple of 4"):
        load_arch("wan2.1-14b").tokens(480, 832, 80)


def test_flops_and_tp_split():
    arch = load_arch("wan2.1-1.3b")
    tokens = arch.tokens(480, 832, 81)
    one, two = forward_flops(arch, tokens, 1), forward_flops(arch, tokens, 2)
    d, t = arch.hidden_size, tokens["image"]
    # Self-attention over the video plus cross-attention to the text, 4 FLOPs per (query, key, channel).
    assert one["attention"] == 30 * 4.0 * d * (t * t + t * tokens["text"])
    assert two["attention"] == one["attention"] / 2
    assert 0.5 < two["linear"] / one["linear"] < 0.51  # only the small replicated layers are not split
    assert params_per_rank(arch, 2) < 0.51 * param_counts(arch)["total"]


def _calibration_tool():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "calibrate_activations.py")
    spec = importlib.util.spec_from_file_location("calibrate_activations", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("lora_rank", [0, 6])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_fit_predicts_an_unseen_config(checkpointing, lora_rank, tp):
    """Measure saved bytes of configs outside the calibration grid (full fine-tuning and LoRA, TP 1 and 2 on a fake
    process group) and compare with the fitted prediction."""
    tool = _calibration_tool()
    cases = [("flux", {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2,
                       "attention_head_dim": 12, "num_attention_heads": 6, "joint_attention_dim": 48,
                       "pooled_projection_dim": 24, "guidance_embeds": True, "axes_dims_rope": [4, 4, 4]},
              {"image": 36, "text": 12}),
             ("wan", {"patch_size": [1, 2, 2], "num_attention_heads": 6, "attention_head_dim": 12, "in_channels": 4,
                      "out_channels": 4, "text_dim": 24, "freq_dim": 8, "ffn_dim": 80, "num_layers": 3,
                      "rope_max_seq_len": 32}, {"image": 2 * 5 * 3, "text": 12}),
             ("qwen_image", {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 4,
                             "attention_head_dim": 12, "num_attention_heads": 6, "joint_attention_dim": 48,
                             "axes_dims_rope": [4, 4, 4]}, {"image": 36, "text": 12})]
    with warnings.catch_warnings(), tool.tp_world(tp):
        warnings.simplefilter("ignore")
        for family, config, counts in cases:
            model = tool.build_case(family, config, torch.float32, checkpointing, lora_rank)
            if family in tool.IMAGE_GRIDS:
                run = tool.IMAGE_GRIDS[family][1](config, counts["image"], counts["text"], torch.float32)
            else:
                run = tool._wan_sample(config, (2, 10, 6), counts["text"], torch.float32)
            measured = tool.measure_saved_bytes(model, lambda: run(model))
            tokens = {**counts, "joint": counts["image"] + counts["text"], "sample": 1}
            predicted = act.saved_bytes(arch_from_config(family, config), tokens, batch=1, dtype_bytes=4,
                                        checkpointing=checkpointing, tp=tp, lora_rank=lora_rank)
            assert abs(predicted / measured - 1) < 0.08, (family, predicted, measured)
