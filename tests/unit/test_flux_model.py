"""The FLUX policy against diffusers' FluxTransformer2DModel, and its sizes, errors and checkpointing."""

import pytest
import torch

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.models import build_policy, load_policy

TINY = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 24, "guidance_embeds": True,
        "axes_dims_rope": [4, 6, 6]}


def make_diffusers_flux(folder, *, guidance: bool = True, seed: int = 0, dtype=torch.float32, **save_kwargs):
    """A random tiny diffusers FLUX transformer saved with save_pretrained; returns the model."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**{**TINY, "guidance_embeds": guidance}).eval()
    with torch.no_grad():  # default init leaves the q/k norms at one: make them informative too
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for param in model.parameters():  # cast in place: ModelMixin.to(dtype) logs a warning
            param.data = param.data.to(dtype)
    model.save_pretrained(str(folder), **save_kwargs)
    return model


def flux_inputs(height: int, width: int, text_len: int, *, batch: int = 2, guidance: bool = True, seed: int = 0):
    """Random FLUX inputs for a grid of height x width packed latent tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros(height * width), rows.flatten(), cols.flatten()], dim=1).float()
    return dict(hidden_states=torch.randn(batch, height * width, 16, generator=gen),
                encoder_hidden_states=torch.randn(batch, text_len, 32, generator=gen),
                pooled_projections=torch.randn(batch, 24, generator=gen),
                timestep=torch.rand(batch, generator=gen), img_ids=img_ids, txt_ids=torch.zeros(text_len, 3),
                guidance=torch.full((batch,), 3.5) if guidance else None)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("guidance", [True, False])
def test_converted_policy_matches_diffusers(tmp_path, guidance):
    ref = make_diffusers_flux(tmp_path / "diffusers", guidance=guidance)
    assert convert_main(["diffusers-to-mcore", "--model", "flux", "--src", str(tmp_path / "diffusers"),
                         "--dst", str(tmp_path / "ours")]) == 0
    ours = load_policy(tmp_path / "ours", backend="local")
    assert ours.config.guidance_embeds is guidance
    for height, width, text_len in [(4, 4, 8), (8, 4, 5), (8, 8, 16)]:
        inputs = flux_inputs(height, width, text_len, guidance=guidance)
        with torch.no_grad():
            expected = ref(**inputs, return_dict=False)[0]
            out = ours(**inputs)
        assert out.shape == expected.shape == (2, height * width, 16)
        assert rel_err(out, expected) <= 1e-5


def test_load_policy_reads_diffusers_directory_directly(tmp_path):
    ref = make_diffusers_flux(tmp_path / "d", seed=1)
    ours = load_policy(tmp_path / "d")
    inputs = flux_inputs(4, 4, 6, batch=1)
    with torch.no_grad():
        assert rel_err(ours(**inputs), ref(**inputs, return_dict=False)[0]) <= 1e-5
    assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())


def test_activation_checkpointing_gives_same_output_and_gradients():
    plain = build_policy({"family": "flux", **TINY}, seed=4)
    ckpt = build_policy({"family": "flux", **TINY, "activation_checkpointing": True}, seed=4)
    inputs = flux_inputs(4, 4, 8)
    outs = []
    for model in (plain, ckpt):
        out = model(**inputs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out.detach())
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


def test_build_policy_is_seeded_and_sizes_are_reported():
    a = build_policy("flux-tiny", seed=1)
    b = build_policy("flux-tiny", seed=1)
    c = build_policy("flux-tiny", seed=2)
    weights = [m.transformer_blocks[0].attn.to_qkv.weight for m in (a, b, c)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert a.hidden_size == 32 and a.num_layers == 2 and len(a.blocks()) == 2
    assert a.tokens_for(512, 256) == 32 * 16
    with pytest.raises(ValueError, match="frames"):
        a.tokens_for(512, 512, frames=5)
    with pytest.raises(ValueError, match="multiples of 16"):
        a.tokens_for(500, 512)


def test_dev_preset_has_flux_dev_size():
    from leangrpo_mcore.models.flux import FluxConfig, PRESETS
    from leangrpo_mcore.models.flux.convert import expected_shapes

    config = FluxConfig.from_diffusers_config(PRESETS["flux-dev"])
    total = sum(shape.numel() for shape in expected_shapes(config).values())
    assert 11.85e9 < total < 11.95e9  # FLUX.1-dev's transformer has 11.9B parameters
    assert config.to_diffusers_config() == {**PRESETS["flux-dev"]}


def test_bad_inputs_raise_one_line_errors():
    model = build_policy({"family": "flux", **TINY})
    inputs = flux_inputs(4, 4, 8)
    with pytest.raises(ValueError, match="guidance"):
        model(**{**inputs, "guidance": None})
    with pytest.raises(ValueError, match="hidden_states"):
        model(**{**inputs, "hidden_states": torch.randn(2, 16, 15)})
    with pytest.raises(ValueError, match="axes_dims_rope"):
        build_policy({"family": "flux", **TINY, "axes_dims_rope": [4, 4, 4]})
    with pytest.raises(ValueError, match="unknown keys"):
        build_policy({"family": "flux", **TINY, "num_frames": 3})
