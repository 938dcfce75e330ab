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
    host = model.transformer_blocks[0].attn.to_q
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

    model, hosts = _model(seed=1)
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
    assert torch.equal(base["transformer_blocks.0.attn.to_q.weight"], host.weight)
    b = adapters["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"]
    assert torch.allclose(b, host.lora_B.weight * 2.0)  # alpha / rank = 8 / 4 folded into B


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
