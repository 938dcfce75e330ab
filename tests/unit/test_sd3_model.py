"""The SD3 policy against diffusers' SD3Transformer2DModel: forward parity in fp32 on converted weights, the
bit-exact conversion round trip (CLI both ways), presets, pipeline stages, LoRA targets and bad input."""

import json

import pytest
import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import load_file

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, get_family, load_policy
from leangrpo_mcore.models.common.pipeline import split_blocks
from leangrpo_mcore.models.sd3 import PRESETS, SD3Config
from leangrpo_mcore.models.sd3.convert import expected_shapes, positional_table

TINY = PRESETS["sd3-tiny"]


def make_diffusers_sd3(folder=None, *, seed: int = 0, **overrides) -> SD3Transformer2DModel:
    """A random tiny diffusers SD3 (dual attention in blocks 0 and 1) with every tensor away from its init."""
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():  # default init leaves the norms at one and the adaLN-zero gates at zero
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))
    if folder is not None:
        model.save_pretrained(str(folder))
    return model


def sd3_inputs(height: int, width: int, text_len: int, *, batch: int = 2, seed: int = 0) -> dict:
    """Random SD3 inputs for a (height, width) latent grid; timesteps on the 0..1000 scale."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 16, height, width, generator=gen),
                encoder_hidden_states=torch.randn(batch, text_len, TINY["joint_attention_dim"], generator=gen),
                pooled_projections=torch.randn(batch, TINY["pooled_projection_dim"], generator=gen),
                timestep=torch.rand(batch, generator=gen) * 1000)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def test_converted_policy_matches_diffusers(tmp_path):
    ref = make_diffusers_sd3(tmp_path / "diffusers")
    assert convert_main(["diffusers-to-mcore", "--model", "sd3", "--src", str(tmp_path / "diffusers"),
                         "--dst", str(tmp_path / "ours")]) == 0
    ours = load_policy(tmp_path / "ours", backend="local")
    assert ours.config.dual_attention_layers == (0, 1) and ours.config.qk_norm == "rms_norm"
    # Square, non-square and odd grids: the positional crop is off-centre for odd margins.
    for height, width, text_len in [(8, 8, 7), (12, 6, 5), (6, 10, 9)]:
        inputs = sd3_inputs(height, width, text_len)
        with torch.no_grad():
            expected = ref(**inputs, return_dict=False)[0]
            out = ours(**inputs)
        assert out.shape == expected.shape == (2, 16, height, width)
        assert rel_err(out, expected) <= 1e-5


def test_load_policy_reads_diffusers_directory_directly(tmp_path):
    ref = make_diffusers_sd3(tmp_path / "d", seed=1, dual_attention_layers=[1], qk_norm=None)
    ours = load_policy(tmp_path / "d")
    inputs = sd3_inputs(8, 8, 6, batch=1)
    with torch.no_grad():
        assert rel_err(ours(**inputs), ref(**inputs, return_dict=False)[0]) <= 1e-5
    table = ref.pos_embed.pos_embed.numel()  # a buffer in diffusers, recomputed here
    assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())
    assert sum(t.numel() for t in ref.state_dict().values()) == ours.num_parameters() + table


def test_round_trip_through_the_cli_is_bit_exact(tmp_path):
    make_diffusers_sd3(tmp_path / "d", seed=2)
    for argv in (["diffusers-to-mcore", "--model", "sd3", "--src", str(tmp_path / "d"), "--dst", str(tmp_path / "o")],
                 ["mcore-to-diffusers", "--src", str(tmp_path / "o"), "--dst", str(tmp_path / "back")]):
        assert convert_main(argv) == 0
    original = load_file(str(tmp_path / "d" / "diffusion_pytorch_model.safetensors"))
    back = load_file(str(tmp_path / "back" / "diffusion_pytorch_model.safetensors"))
    assert sorted(back) == sorted(original) and "pos_embed.pos_embed" in back
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["_class_name"] == "SD3Transformer2DModel" and config["dual_attention_layers"] == [0, 1]
    reloaded = SD3Transformer2DModel.from_pretrained(str(tmp_path / "back"))
    assert torch.equal(reloaded.transformer_blocks[0].attn2.to_k.weight, original["transformer_blocks.0.attn2.to_k.weight"])


def test_positional_table_is_diffusers_buffer_for_other_sizes():
    for overrides in ({"pos_embed_max_size": 12, "sample_size": 6}, {"pos_embed_max_size": 10, "sample_size": 16}):
        ref = SD3Transformer2DModel(**{**TINY, **overrides})
        config = SD3Config.from_diffusers_config({**TINY, **overrides})
        assert torch.equal(positional_table(config), ref.pos_embed.pos_embed)


@pytest.mark.parametrize("name, params", [("sd3.5-medium", 2_243_171_520), ("sd3.5-large", 8_056_627_520)])
def test_released_presets_match_diffusers_shapes(name, params):
    with torch.device("meta"):
        ref = SD3Transformer2DModel(**PRESETS[name])
    config = SD3Config.from_diffusers_config(PRESETS[name])
    ours = {k: tuple(v) for k, v in expected_shapes(config).items()}
    plan = get_family("sd3").diffusers_plan(config)
    stored = {piece.key: piece.stored_shape for a in plan.values() for piece in a.pieces}
    expected = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k != "pos_embed.pos_embed"}
    assert stored == expected
    assert sum(torch.Size(s).numel() for s in ours.values()) == sum(p.numel() for p in ref.parameters()) == params
    assert config.to_diffusers_config() == {**PRESETS[name]}


def test_pipeline_stages_compose_to_the_whole_model():
    inputs = sd3_inputs(8, 8, 5)
    whole = build_policy("sd3-tiny", seed=3)
    with torch.no_grad():
        expected = whole(**inputs)
        boundary = None
        for stage in split_blocks(3, 2, sizes=[2, 1]):
            part = build_policy("sd3-tiny", seed=3, stage=stage)
            if boundary is not None:
                part.set_input_tensor(boundary)
            boundary = part(**inputs)
    assert boundary.shape == expected.shape and torch.equal(boundary, expected)


def test_activation_checkpointing_gives_same_gradients():
    inputs = sd3_inputs(8, 8, 5)
    grads = []
    for checkpointing in (False, True):
        model = build_policy({"preset": "sd3-tiny", "activation_checkpointing": checkpointing}, seed=4)
        out = model(**inputs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], rtol=1e-5, atol=1e-7), name


def test_lora_targets_are_flowgrpo_joint_attention_projections():
    model = build_policy("sd3-tiny")
    adapted = apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=get_family("sd3").lora_targets))
    # 3 blocks x (q, k, v, out, add q, k, v) + to_add_out of the two blocks that are not context-pre-only.
    assert len(adapted) == 3 * 7 + 2
    assert not any("attn2" in name or ".ff" in name for name in adapted)


def test_sizes_and_bad_inputs():
    model = build_policy("sd3-tiny")
    assert model.tokens_for(512, 256) == 32 * 16 and model.hidden_size == 32 and len(model.blocks()) == 3
    with pytest.raises(ValueError, match="multiples of 16"):
        model.tokens_for(500, 512)
    with pytest.raises(ValueError, match="hidden_states"):
        model(**{**sd3_inputs(8, 8, 4), "hidden_states": torch.randn(2, 4, 8, 8)})
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        model(**sd3_inputs(34, 8, 4))  # 17 token rows > 16
    with pytest.raises(ValueError, match="caption_projection_dim"):
        SD3Config.from_diffusers_config({**TINY, "caption_projection_dim": 48})
    with pytest.raises(ValueError, match="dual_attention_layers"):
        SD3Config.from_diffusers_config({**TINY, "dual_attention_layers": [3]})
    with pytest.raises(ValueError, match="unknown keys"):
        SD3Config.from_diffusers_config({**TINY, "guidance_embeds": True})
