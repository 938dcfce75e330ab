"""Wan config and state-dict conversion: presets match diffusers, round trips are bit-exact, bad input is refused."""

import json
import math

import pytest
import torch
from diffusers import WanTransformer3DModel

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.wan.config import PRESETS, WanConfig
from leangrpo_mcore.models.wan.convert import (
    diffusers_shapes,
    diffusers_to_mcore,
    mcore_shapes,
    mcore_to_diffusers,
)

# Parameter counts of the released transformers (diffusers WanTransformer3DModel on the meta device).
RELEASED_SIZES = {"wan2.1-1.3b": 1_418_996_800, "wan2.1-14b": 14_288_491_584, "wan2.2-ti2v-5b": 4_999_787_712}


def _tiny_diffusers(seed: int = 0, **overrides) -> tuple[WanTransformer3DModel, WanConfig]:
    hp = {**PRESETS["tiny"], **overrides}
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**hp)
    # diffusers zero-initialises nothing here, but make every tensor distinct from its init to catch mix-ups.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model, WanConfig.from_diffusers_config(dict(model.config))


@pytest.mark.parametrize("name", sorted(RELEASED_SIZES))
def test_released_presets_match_diffusers_shapes(name):
    with torch.device("meta"):
        ref = WanTransformer3DModel(**PRESETS[name])
    config = WanConfig.from_diffusers_config(PRESETS[name])
    expected = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert diffusers_shapes(config) == expected
    total = sum(math.prod(s) for s in mcore_shapes(config).values())
    assert total == sum(p.numel() for p in ref.parameters()) == RELEASED_SIZES[name]


def test_config_round_trip_and_fields():
    d = PRESETS["wan2.1-14b"]
    meta = {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0"}
    config = WanConfig.from_diffusers_config({**meta, **d})
    assert (config.hidden_size, config.num_attention_heads, config.kv_channels) == (5120, 40, 128)
    assert (config.ffn_hidden_size, config.num_layers, config.layernorm_epsilon) == (13824, 40, 1e-6)
    assert config.use_cpu_initialization and config.hidden_dropout == 0 and config.attention_dropout == 0
    back = config.to_diffusers_config()
    assert json.loads(json.dumps(back)) == {**d, "patch_size": [1, 2, 2]}
    assert WanConfig.from_diffusers_config(back).to_diffusers_config() == back
    assert WanConfig.from_diffusers_config(PRESETS["wan2.2-ti2v-5b"]).vae_scale_factor_spatial == 16
    assert config.vae_scale_factor_spatial == 8


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"_class_name": "FluxTransformer2DModel"}, "not a Wan transformer config"),
        ({"joint_attention_dim": 4096}, "unknown keys"),
        ({"pos_embed_seq_len": 514}, "FLF2V"),  # image-to-video is supported, first-last-frame is not
        ({"image_dim": 1280, "added_kv_proj_dim": 5120}, "must be the model width"),
        ({"qk_norm": "rms_norm"}, "qk_norm"),
        ({"patch_size": [1, 2]}, "patch_size"),
    ],
)
def test_config_rejects_unsupported(bad, message):
    with pytest.raises(UserError, match=message):
        WanConfig.from_diffusers_config({**PRESETS["tiny"], **bad})


def test_round_trip_is_bit_exact():
    model, config = _tiny_diffusers(cross_attn_norm=True)
    sd = model.state_dict()
    ours = diffusers_to_mcore(sd, config)
    assert ours["patch_embedding.weight"].shape == (24, 16)
    assert "layers.1.ffn.fc2.weight" in ours and "layers.0.attn1.to_out.bias" in ours
    back = mcore_to_diffusers(ours, config)
    assert sorted(back) == sorted(sd)
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


def test_round_trip_without_cross_attn_norm_and_temporal_patch():
    model, config = _tiny_diffusers(seed=1, cross_attn_norm=False, patch_size=[2, 2, 2])
    sd = model.state_dict()
    ours = diffusers_to_mcore(sd, config)
    assert not any("norm2" in k for k in ours)
    assert ours["patch_embedding.weight"].shape == (24, 32)
    back = mcore_to_diffusers(ours, config)
    assert all(torch.equal(back[k], v) for k, v in sd.items()) and len(back) == len(sd)


def test_conversion_rejects_wrong_or_corrupt_state_dicts():
    model, config = _tiny_diffusers()
    sd = dict(model.state_dict())
    with pytest.raises(UserError, match="unexpected keys"):
        diffusers_to_mcore({**sd, "transformer_blocks.0.attn.to_q.weight": torch.zeros(1)}, config)
    missing = {k: v for k, v in sd.items() if k != "blocks.1.attn2.norm_k.weight"}
    with pytest.raises(UserError, match="missing keys"):
        diffusers_to_mcore(missing, config)
    with pytest.raises(UserError, match="shape"):
        diffusers_to_mcore({**sd, "proj_out.bias": torch.zeros(3)}, config)
    deeper = WanConfig.from_diffusers_config({**PRESETS["tiny"], "num_layers": 3})
    with pytest.raises(UserError, match="missing keys"):
        diffusers_to_mcore(sd, deeper)
    with pytest.raises(UserError, match="unexpected keys"):
        mcore_to_diffusers(sd, config)
