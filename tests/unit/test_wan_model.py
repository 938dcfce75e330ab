"""The Wan policy equals diffusers' WanTransformer3DModel (fp32, <= 1e-5 relative) after `leangrpo-convert`,
and its export loads back into diffusers bit-exactly."""

import pytest

from tests.once import once_per_process
import torch
from diffusers import WanTransformer3DModel

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.models import build_policy, load_policy
from leangrpo_mcore.models.wan import PRESETS, WanConfig, WanModel, diffusers_to_mcore

TOL = 1e-5


def make_diffusers_wan(seed: int = 0, **overrides) -> WanTransformer3DModel:
    """A random tiny diffusers Wan transformer whose every tensor (norm scales, biases) is non-trivial."""
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**PRESETS["tiny"], **overrides}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def _inputs(frames: int, text_len: int, seed: int, height: int = 8, width: int = 6):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, frames, height, width, generator=gen)
    text = torch.randn(2, text_len, 16, generator=gen)
    return latents, torch.tensor([937.0, 12.5]), text


@pytest.fixture(scope="module")
@once_per_process
def converted(tmp_path_factory):
    """(diffusers reference, our policy loaded from the `leangrpo-convert` output, work dir)."""
    root = tmp_path_factory.mktemp("wan")
    ref = make_diffusers_wan()
    ref.save_pretrained(str(root / "diffusers"))
    argv = ["diffusers-to-mcore", "--model", "wan", "--src", str(root / "diffusers"), "--dst", str(root / "ours")]
    assert convert_main(argv) == 0
    return ref, load_policy(root / "ours", backend="local"), root


@pytest.mark.parametrize("frames, text_len", [(1, 3), (5, 11), (9, 7)])
def test_policy_matches_diffusers(converted, frames, text_len):
    ref, policy, _ = converted
    latents, timestep, text = _inputs(frames, text_len, seed=frames)
    with torch.no_grad():
        expected = ref(latents, timestep, text, return_dict=False)[0]
        out = policy(hidden_states=latents, timestep=timestep, encoder_hidden_states=text)
    assert out.shape == expected.shape == latents.shape
    assert _rel(out, expected) <= TOL


def test_per_token_timesteps_match_diffusers(converted):
    """Wan2.2-TI2V feeds one timestep per video token."""
    ref, policy, _ = converted
    latents, _, text = _inputs(3, 5, seed=21)
    timestep = torch.rand(2, 3 * 4 * 3, generator=torch.Generator().manual_seed(2)) * 1000
    with torch.no_grad():
        expected = ref(latents, timestep, text, return_dict=False)[0]
        out = policy(hidden_states=latents, timestep=timestep, encoder_hidden_states=text)
    assert _rel(out, expected) <= TOL


def test_temporal_patch_without_cross_attention_norm():
    ref = make_diffusers_wan(seed=4, patch_size=[2, 2, 2], cross_attn_norm=False)
    config = WanConfig.from_diffusers_config(dict(ref.config))
    policy = WanModel(config, backend="local")
    policy.load_state_dict(diffusers_to_mcore(ref.state_dict(), config), strict=True)
    for frames in (2, 6):
        latents, timestep, text = _inputs(frames, 4, seed=frames, height=4, width=10)
        with torch.no_grad():
            expected = ref(latents, timestep, text, return_dict=False)[0]
            assert _rel(policy(latents, timestep, text), expected) <= TOL
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        policy(torch.zeros(1, 4, 3, 4, 4), timestep[:1], text[:1])


def test_export_loads_in_diffusers(converted):
    ref, policy, root = converted
    argv = ["mcore-to-diffusers", "--src", str(root / "ours"), "--dst", str(root / "export")]
    assert convert_main(argv) == 0
    back = WanTransformer3DModel.from_pretrained(str(root / "export")).eval()
    original = ref.state_dict()
    exported = back.state_dict()
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    latents, timestep, text = _inputs(5, 6, seed=8)
    with torch.no_grad():
        assert torch.equal(back(latents, timestep, text, return_dict=False)[0],
                           ref(latents, timestep, text, return_dict=False)[0])


def test_sizes_and_structure(converted):
    ref, policy, _ = converted
    assert policy.num_parameters() == sum(p.numel() for p in ref.parameters()) == 19640
    assert (policy.hidden_size, policy.num_layers, len(policy.blocks())) == (24, 2, 2)
    assert policy.blocks()[1] is policy.layers[1]
    # 81 frames of 480x832 -> 21 latent frames of 60x104 -> 21*30*52 tokens (Wan2.1's VAE and 1x2x2 patches).
    assert policy.tokens_for(480, 832, 81) == 32760
    assert policy.tokens_for(64, 32) == 4 * 2
    with pytest.raises(ValueError, match="1 \\+ a multiple of 4"):
        policy.tokens_for(480, 832, 80)
    with pytest.raises(ValueError, match="multiples of 16"):
        policy.tokens_for(480, 840, 81)


@pytest.mark.parametrize("preset, params, tokens", [
    ("wan2.1-1.3b", 1_418_996_800, 32760),  # 81 frames of 480x832
    ("wan2.2-ti2v-5b", 4_999_787_712, 27280),  # 121 frames of 704x1280: 31 latent frames of 44x80 (16x VAE)
])
def test_released_sizes_on_meta_device(preset, params, tokens):
    with torch.device("meta"):
        model = WanModel(WanConfig.from_diffusers_config(PRESETS[preset]), backend="local")
    assert model.num_parameters() == params
    frames, height, width = (81, 480, 832) if preset == "wan2.1-1.3b" else (121, 704, 1280)
    assert model.tokens_for(height, width, frames) == tokens


def test_seeded_init_and_activation_checkpointing():
    base = build_policy({"preset": "tiny"}, seed=5, backend="local")
    again = build_policy({"preset": "tiny"}, seed=5, backend="local")
    other = build_policy({"preset": "tiny"}, seed=6, backend="local")
    ckpt = build_policy({"preset": "tiny", "activation_checkpointing": True}, seed=5, backend="local")
    assert ckpt.config.activation_checkpointing and not base.config.activation_checkpointing
    params = dict(base.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())
    assert not torch.equal(other.layers[0].attn1.to_qkv.weight, base.layers[0].attn1.to_qkv.weight)
    latents, timestep, text = _inputs(3, 5, seed=1)
    grads, saved = [], []
    for model in (base, ckpt):
        count = [0]

        def pack(t, count=count):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text)
        out.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        saved.append(count[0])
    assert saved[1] < saved[0] / 2  # checkpointed blocks keep only their inputs for backward
    assert all(torch.allclose(grads[1][n], g, rtol=1e-6, atol=1e-8) for n, g in grads[0].items())
    assert grads[0]["layers.0.scale_shift_table"].abs().sum() > 0


def test_bad_inputs_raise_one_line_errors(converted):
    _, policy, _ = converted
    latents, timestep, text = _inputs(1, 3, seed=0)
    with pytest.raises(ValueError, match=r"hidden_states must be \(B, 4, F, H, W\)"):
        policy(latents[:, :3], timestep, text)
    with pytest.raises(ValueError, match="encoder_hidden_states must be"):
        policy(latents, timestep, text[..., :8])
    with pytest.raises(ValueError, match="timestep must be"):
        policy(latents, timestep[:1].expand(3), text)
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        policy(torch.zeros(1, 4, 33, 2, 2), timestep[:1], text[:1])


def test_lora_targets_adapt_every_attention_projection(converted):
    from leangrpo_mcore.models import LoRAConfig, apply_lora, merge_lora
    from leangrpo_mcore.models.wan import FAMILY

    _, _, root = converted
    policy = load_policy(root / "ours", backend="local")
    latents, timestep, text = _inputs(3, 4, seed=3)
    with torch.no_grad():
        base = policy(latents, timestep, text)
    adapted = apply_lora(policy, LoRAConfig(rank=2, alpha=4.0, targets=FAMILY.lora_targets), seed=1)
    assert len(adapted) == 2 * 2 * 4 and "layers.1.attn2.to_out" in adapted
    with torch.no_grad():
        assert torch.equal(policy(latents, timestep, text), base)  # B = 0 at init
        for name in adapted:
            policy.get_submodule(name).lora_B.weight.normal_(std=0.05)
        tuned = policy(latents, timestep, text)
        assert _rel(tuned, base) > 1e-3
        merge_lora(policy)
        assert _rel(policy(latents, timestep, text), tuned) <= TOL
