"""LoRA on the FLUX policy: identity at init, adapter-only training, disable/merge, export round trips."""

import pytest
import torch
from safetensors.torch import load_file

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.models import (
    LoRAConfig,
    apply_lora,
    build_policy,
    disable_adapters,
    get_family,
    lora_parameters,
    mark_only_lora_trainable,
    merge_lora,
    save_policy,
    unmerge_lora,
)
from tests.unit.test_flux_model import TINY, flux_inputs, rel_err

TARGETS = get_family("flux").lora_targets


def _model(seed=0):
    model = build_policy({"family": "flux", **TINY}, seed=seed)
    hosts = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=TARGETS), seed=seed)
    return model, hosts


def _train(model, steps=3):
    mark_only_lora_trainable(model)
    optimizer = torch.optim.Adam(lora_parameters(model), lr=1e-2)
    inputs = flux_inputs(4, 4, 6, seed=3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(**inputs).pow(2).mean().backward()
        optimizer.step()


def test_targets_select_flowgrpo_linears_and_init_is_identity():
    base = build_policy({"family": "flux", **TINY}, seed=0)
    model, hosts = _model()
    assert "transformer_blocks.0.ff.net.0.proj" in hosts and "transformer_blocks.0.ff_context.net.2" in hosts
    assert "single_transformer_blocks.0.attn.to_q" in hosts and "transformer_blocks.0.attn.to_out.0" in hosts
    assert not any("proj_mlp" in h or "norm" in h or h == "proj_out" for h in hosts)
    assert len(hosts) == 8 + 4 + 3  # double attention + two MLPs + single attention q/k/v
    inputs = flux_inputs(4, 4, 8)
    with torch.no_grad():
        assert torch.equal(model(**inputs), base(**inputs))
    with pytest.raises(ValueError, match="matches no module"):
        apply_lora(build_policy({"family": "flux", **TINY}), LoRAConfig(rank=2, alpha=2, targets=("to_qq",)))
    with pytest.raises(ValueError, match="already"):
        apply_lora(model, LoRAConfig(rank=2, alpha=2, targets=("to_q",)))


def test_only_adapters_get_gradients_and_disable_gives_base():
    model, hosts = _model()
    inputs = flux_inputs(4, 4, 6)
    with torch.no_grad():
        base_out = model(**inputs)
    trainable = mark_only_lora_trainable(model)
    assert trainable == sum(p.numel() for p in lora_parameters(model)) > 0
    model(**inputs).sum().backward()
    for name, param in model.named_parameters():
        if ".lora_" in name:
            assert param.grad is not None
        else:
            assert param.grad is None, name
    # B is zero at init, so only the B factors move on the first step: A's gradient is exactly zero.
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("lora_B.weight"))
    assert all(p.grad.abs().sum() == 0 for n, p in model.named_parameters() if n.endswith("lora_A.weight"))
    _train(model)
    with torch.no_grad():
        trained = model(**inputs)
        with disable_adapters(model):
            disabled = model(**inputs)
        again = model(**inputs)
    assert rel_err(trained, base_out) > 1e-3
    assert torch.equal(disabled, base_out)
    assert torch.equal(again, trained)


def test_merge_unmerge_and_guards(tmp_path):
    model, _ = _model()
    _train(model)
    inputs = flux_inputs(4, 4, 6)
    host = model.transformer_blocks[0].attn.to_qkv  # the base weight of the to_q / to_k / to_v adapters
    original = host.weight.detach().clone()
    with torch.no_grad():
        lora_out = model(**inputs)
        assert merge_lora(model) == 15
        merged_out = model(**inputs)
        with pytest.raises(ValueError, match="unmerged"):
            with disable_adapters(model):
                pass
        with pytest.raises(ValueError, match="unmerged"):
            save_policy(model, tmp_path / "x")
        assert unmerge_lora(model) == 15
    assert rel_err(merged_out, lora_out) < 1e-5
    assert torch.allclose(host.weight, original, atol=1e-6)


def test_merged_export_loads_in_diffusers_and_keep_lora_exports_peft_weights(tmp_path):
    from diffusers import FluxTransformer2DModel

    model = build_policy({"family": "flux", **TINY}, seed=1)
    # + proj_out: the single block's interleaves its input columns per head, so A must be put back in order.
    hosts = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=TARGETS + ("proj_out",)), seed=1)
    _train(model)
    save_policy(model, tmp_path / "ours")
    assert convert_main(["mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "merged")]) == 0
    exported = FluxTransformer2DModel.from_pretrained(str(tmp_path / "merged")).eval()
    inputs = flux_inputs(8, 4, 5)
    with torch.no_grad():
        assert rel_err(exported(**inputs, return_dict=False)[0], model(**inputs)) <= 1e-5

    assert convert_main(["mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "kept"),
                         "--keep-lora"]) == 0
    base = load_file(str(tmp_path / "kept" / "diffusion_pytorch_model.safetensors"))
    adapters = load_file(str(tmp_path / "kept" / "pytorch_lora_weights.safetensors"))
    assert len(adapters) == 2 * len(hosts)
    host = model.transformer_blocks[0].attn.to_q
    assert torch.equal(base["transformer_blocks.0.attn.to_q.weight"], host.weight_rows().reshape(-1, 32))
    b = adapters["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"]
    assert torch.allclose(b, host.lora_B.weight * 2.0)  # alpha / rank = 8 / 4 folded into B
    # The exported adapters on diffusers' separate linears reproduce ours (PEFT's formula W x + B A x).
    exported_base = FluxTransformer2DModel.from_pretrained(str(tmp_path / "kept")).eval()
    with torch.no_grad():
        for name, module in exported_base.named_modules():
            key = f"transformer.{name}.lora_A.weight"
            if key in adapters:
                module.weight += adapters[key.replace("lora_A", "lora_B")] @ adapters[key]
        assert rel_err(exported_base(**inputs, return_dict=False)[0], model(**inputs)) <= 1e-5


def test_wan_keep_lora_names_adapters_in_diffusers_terms(tmp_path):
    wan = get_family("wan")
    model = build_policy({"family": "wan", "preset": "tiny"})
    hosts = apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=wan.lora_targets), seed=0)
    save_policy(model, tmp_path / "ours")
    assert convert_main(["mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "kept"),
                         "--keep-lora"]) == 0
    base = load_file(str(tmp_path / "kept" / "diffusion_pytorch_model.safetensors"))
    adapters = load_file(str(tmp_path / "kept" / "pytorch_lora_weights.safetensors"))
    assert len(adapters) == 2 * len(hosts)
    for key in adapters:  # every adapter sits on a diffusers weight name (blocks.N..., to_out.0)
        host = key[len("transformer."):].rsplit(".lora_", 1)[0]
        assert f"{host}.weight" in base, key
    assert "transformer.blocks.0.attn1.to_out.0.lora_A.weight" in adapters


def test_adapters_on_fused_qkv_are_per_projection():
    from leangrpo_mcore.models.common.lora import LoRASlot

    model = build_policy({"family": "flux", **TINY}, seed=2)
    hosts = apply_lora(model, LoRAConfig(rank=2, alpha=2.0, targets=("transformer_blocks.0.attn.to_q",
                                                                     "transformer_blocks.0.attn.to_v")), seed=4)
    assert hosts == ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v"]
    attn = model.transformer_blocks[0].attn
    assert isinstance(attn.to_q, LoRASlot) and not attn.to_k.has_lora()
    assert attn.to_q.lora_A.weight.shape == (2, 32) and attn.to_q.lora_B.weight.shape == (32, 2)
    with torch.no_grad():
        attn.to_q.lora_B.weight.normal_()
        attn.to_v.lora_B.weight.normal_()
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        with disable_adapters(model):
            base = attn.to_qkv(x).unflatten(-1, (2, 3, 16))
        delta = attn.to_qkv(x).unflatten(-1, (2, 3, 16)) - base
        for index, slot in ((0, attn.to_q), (2, attn.to_v)):
            expected = (x @ slot.lora_A.weight.T @ slot.lora_B.weight.T).unflatten(-1, (2, 16))
            assert torch.allclose(delta[..., index, :], expected, atol=1e-5)
            assert expected.abs().max() > 0.1
        assert torch.equal(delta[..., 1, :], torch.zeros_like(delta[..., 1, :]))  # k has no adapter
        weight = attn.to_qkv.weight.detach().clone().view(2, 3, 16, 32)
        merge_lora(model)
        moved = (attn.to_qkv.weight.view(2, 3, 16, 32) - weight).abs().amax(dim=(0, 2, 3))
        assert moved[0] > 0 and moved[1] == 0 and moved[2] > 0
    fused = apply_lora(build_policy({"family": "flux", **TINY}), LoRAConfig(rank=2, alpha=2, targets=("add_qkv_proj",)))
    assert fused == ["transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.attn.add_q_proj",
                     "transformer_blocks.0.attn.add_v_proj"]
