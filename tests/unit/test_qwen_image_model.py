"""The Qwen-Image policy against diffusers' QwenImageTransformer2DModel: forward parity in fp32 on converted
weights (text padding masked, odd and non-square grids), RoPE positions against diffusers' QwenEmbedRope, the
bit-exact conversion round trip (CLI both ways), the released preset's size, pipeline stages, activation
checkpointing, LoRA targets and bad input."""

import json

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
from safetensors.torch import load_file

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, get_family, load_policy
from leangrpo_mcore.models.common.pipeline import split_blocks
from leangrpo_mcore.models.common.rope import multi_axis_rope_cos_sin
from leangrpo_mcore.models.qwen_image import PRESETS, QwenImageConfig
from leangrpo_mcore.models.qwen_image.convert import expected_shapes
from leangrpo_mcore.models.qwen_image.model import rope_ids

TINY = PRESETS["qwen-image-tiny"]


def make_diffusers_qwen(folder=None, *, seed: int = 0, **overrides) -> QwenImageTransformer2DModel:
    """A random tiny diffusers Qwen-Image with every tensor away from its init (the adaLN gates start at zero)."""
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))
    if folder is not None:
        model.save_pretrained(str(folder))
    return model


def qwen_inputs(rows: int, cols: int, text_len: int, *, batch: int = 2, seed: int = 0,
                valid: tuple[int, ...] | None = None) -> dict:
    """Random inputs for a rows x cols token grid; sample i has ``valid[i]`` real text tokens, then padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = None
    if valid is not None:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]).long()
    return dict(hidden_states=torch.randn(batch, rows * cols, TINY["in_channels"], generator=gen),
                encoder_hidden_states=torch.randn(batch, text_len, TINY["joint_attention_dim"], generator=gen),
                encoder_hidden_states_mask=mask, timestep=torch.rand(batch, generator=gen),
                img_shapes=[[(1, rows, cols)]] * batch)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def test_converted_policy_matches_diffusers(tmp_path):
    ref = make_diffusers_qwen(tmp_path / "diffusers")
    assert convert_main(["diffusers-to-mcore", "--model", "qwen_image", "--src", str(tmp_path / "diffusers"),
                         "--dst", str(tmp_path / "ours")]) == 0
    ours = load_policy(tmp_path / "ours", backend="local")
    # Square, non-square and odd grids (the centred rows start at -(h - h // 2)); masks with padding and none.
    for rows, cols, text_len, valid in [(4, 4, 7, (7, 3)), (3, 5, 9, (2, 9)), (5, 2, 6, None)]:
        inputs = qwen_inputs(rows, cols, text_len, valid=valid)
        with torch.no_grad():
            expected = ref(**inputs, return_dict=False)[0]
            out = ours(**inputs)
        assert out.shape == expected.shape == (2, rows * cols, 64)
        assert rel_err(out, expected) <= 1e-5, (rows, cols, text_len)
    # The mask matters (a wrong mask is not within the tolerance) and padding is never read.
    inputs = qwen_inputs(4, 4, 7, valid=(7, 3))
    with torch.no_grad():
        unmasked = ref(**{**inputs, "encoder_hidden_states_mask": None}, return_dict=False)[0]
        padded = inputs["encoder_hidden_states"].clone()
        padded[1, 3:] = 50.0
        changed = ours(**{**inputs, "encoder_hidden_states": padded})
        assert rel_err(ours(**inputs), unmasked) > 1e-2
        assert torch.equal(changed[1], ours(**inputs)[1])


def test_rope_positions_are_diffusers_qwen_embed_rope():
    axes = TINY["axes_dims_rope"]
    rope = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    for grid, text_len in [((1, 4, 6), 5), ((1, 5, 3), 8), ((2, 3, 3), 2)]:
        img_freqs, txt_freqs = rope([grid], max_txt_seq_len=text_len, device=torch.device("cpu"))
        text, image = rope_ids(grid, text_len, "cpu")
        for ids, freqs in ((text, txt_freqs), (image, img_freqs)):
            cos, sin = multi_axis_rope_cos_sin(ids, axes, angle_dtype=torch.float32)
            # diffusers' complex frequency of pair i is our (cos, sin) at channels 2i and 2i + 1.
            assert torch.allclose(cos[:, ::2], freqs.real, atol=1e-6) and torch.equal(cos[:, ::2], cos[:, 1::2])
            assert torch.allclose(sin[:, ::2], freqs.imag, atol=1e-6) and torch.equal(sin[:, ::2], sin[:, 1::2])


def test_round_trip_through_the_cli_is_bit_exact(tmp_path):
    make_diffusers_qwen(tmp_path / "d", seed=2)
    for argv in (["diffusers-to-mcore", "--model", "qwen_image", "--src", str(tmp_path / "d"), "--dst",
                  str(tmp_path / "o")],
                 ["mcore-to-diffusers", "--src", str(tmp_path / "o"), "--dst", str(tmp_path / "back")]):
        assert convert_main(argv) == 0
    original = load_file(str(tmp_path / "d" / "diffusion_pytorch_model.safetensors"))
    back = load_file(str(tmp_path / "back" / "diffusion_pytorch_model.safetensors"))
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel" and config["axes_dims_rope"] == [4, 6, 6]
    reloaded = QwenImageTransformer2DModel.from_pretrained(str(tmp_path / "back"))
    assert torch.equal(reloaded.transformer_blocks[1].attn.add_k_proj.weight,
                       original["transformer_blocks.1.attn.add_k_proj.weight"])


def test_released_preset_matches_diffusers_shapes():
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel(**PRESETS["qwen-image"])
    config = QwenImageConfig.from_diffusers_config(PRESETS["qwen-image"])
    ours = {k: tuple(v) for k, v in expected_shapes(config).items()}
    plan = get_family("qwen_image").diffusers_plan(config)
    stored = {piece.key: piece.stored_shape for a in plan.values() for piece in a.pieces}
    assert stored == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert sum(torch.Size(s).numel() for s in ours.values()) == sum(p.numel() for p in ref.parameters())
    assert sum(p.numel() for p in ref.parameters()) == 20_430_401_088
    assert config.to_diffusers_config() == PRESETS["qwen-image"]


def test_pipeline_stages_compose_to_the_whole_model():
    inputs = qwen_inputs(4, 4, 5, valid=(5, 2))
    whole = build_policy("qwen-image-tiny", seed=3)
    with torch.no_grad():
        expected = whole(**inputs)
        boundary = None
        for stage in split_blocks(2, 2):
            part = build_policy("qwen-image-tiny", seed=3, stage=stage)
            if boundary is not None:
                part.set_input_tensor(boundary)
            if not stage.post_process:
                assert tuple(part.boundary_shape(**inputs)) == (2, 1 + 5 + 16, 32)
            boundary = part(**inputs)
    assert boundary.shape == expected.shape and torch.equal(boundary, expected)


def test_activation_checkpointing_gives_same_gradients():
    inputs = qwen_inputs(4, 4, 5, valid=(5, 2))
    grads = []
    for checkpointing in (False, True):
        model = build_policy({"preset": "qwen-image-tiny", "activation_checkpointing": checkpointing}, seed=4)
        out = model(**inputs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    # The last block's text output feeds nothing (as in diffusers): its text MLP and attention output get no
    # gradient either way.
    dead = {f"transformer_blocks.1.{m}.{p}" for m in ("txt_mlp.net.0.proj", "txt_mlp.net.2", "attn.to_add_out")
            for p in ("weight", "bias")}
    assert {n for n, g in grads[0].items() if g is None} == {n for n, g in grads[1].items() if g is None} == dead
    for name, grad in grads[0].items():
        assert grad is None or torch.allclose(grad, grads[1][name], rtol=1e-5, atol=1e-7), name


def test_lora_targets_are_the_published_attention_and_mlp_projections():
    model = build_policy({"family": "qwen_image", "preset": "tiny"})
    adapted = apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=get_family("qwen_image").lora_targets))
    assert len(adapted) == 2 * 12  # 2 blocks x (8 attention projections + 2 x 2 MLP linears)
    assert not any("_mod" in name or name.startswith(("img_in", "txt_in", "proj_out")) for name in adapted)


def test_sizes_and_bad_inputs():
    model = build_policy("qwen-image-tiny")
    assert model.tokens_for(512, 256) == 32 * 16 and model.hidden_size == 32 and len(model.blocks()) == 2
    with pytest.raises(ValueError, match="multiples of 16"):
        model.tokens_for(500, 512)
    inputs = qwen_inputs(4, 4, 5)
    with pytest.raises(ValueError, match="img_shapes"):
        model(**{**inputs, "img_shapes": (1, 4, 5)})
    with pytest.raises(ValueError, match="one image per sample"):
        model(**{**inputs, "img_shapes": [[(1, 4, 4), (1, 4, 4)]] * 2})
    with pytest.raises(ValueError, match="encoder_hidden_states_mask"):
        model(**{**inputs, "encoder_hidden_states_mask": torch.ones(2, 4)})
    with pytest.raises(ValueError, match="hidden_states"):
        model(**{**inputs, "hidden_states": torch.randn(2, 16, 16)})
    with pytest.raises(ValueError, match="axes_dims_rope"):
        QwenImageConfig.from_diffusers_config({**TINY, "axes_dims_rope": [4, 4, 4]})
    with pytest.raises(ValueError, match="zero_cond_t"):
        QwenImageConfig.from_diffusers_config({**TINY, "zero_cond_t": True})
    with pytest.raises(ValueError, match="unknown keys"):
        QwenImageConfig.from_diffusers_config({**TINY, "pooled_projection_dim": 8})
