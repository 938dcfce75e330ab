"""`leangrpo-convert mcore-to-diffusers` of a LoRA run: the merge W + (alpha / r) B A computed in float32 from the
checkpoint's own tensors (a bf16 frozen base, float32 adapters) in the test, against the exported weights; the
default export dtype (the master weights'); the exported file's mode (the process umask)."""

import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leangrpo_mcore.cli.convert import main as convert
from leangrpo_mcore.cli.train import main as train
from tests.ckpt_helpers import model_tensors
from tests.once import once_per_process

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
RANK, ALPHA = 4, 8.0
FUSED = {"to_q": ("to_qkv", 0), "to_k": ("to_qkv", 1), "to_v": ("to_qkv", 2),
         "add_q_proj": ("add_qkv_proj", 0), "add_k_proj": ("add_qkv_proj", 1), "add_v_proj": ("add_qkv_proj", 2)}
"""Our fused projections hold diffusers' q, k and v rows head by head: (heads, 3, head_dim) rows."""
HEADS = 2
"""Attention heads of the tiny FLUX preset."""


@pytest.fixture(scope="module")
@once_per_process
def lora_checkpoint(tmp_path_factory):
    """A tiny FLUX LoRA run of 2 steps computing in bf16 (so its frozen base is stored in bf16)."""
    run = tmp_path_factory.mktemp("lora") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=2",
                      f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.dtype=bfloat16"]) == 0
    finally:
        torch.set_num_threads(threads)
    return run / "checkpoints" / "step_2"


def _host_base(tensors: dict, host: str) -> torch.Tensor:
    """The frozen base weight of an adapter host, as stored (a row block of a fused projection for q, k, v)."""
    if f"{host}.weight" in tensors:
        return tensors[f"{host}.weight"]
    prefix, name = host.rsplit(".", 1)
    fused, slot = FUSED[name]
    weight = tensors[f"{prefix}.{fused}.weight"]
    per_head = weight.view(HEADS, 3, -1, weight.shape[1])
    return per_head[:, slot].reshape(-1, weight.shape[1])


def _merged_in_test(tensors: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{host: (base in float32, (alpha / r) B A in float32)} of every adapter stored as one diffusers linear."""
    hosts = sorted({key.split(".lora_A.")[0] for key in tensors if ".lora_A." in key})
    out = {}
    for host in hosts:
        if host.startswith("single_transformer_blocks") and host.endswith("proj_out"):
            continue  # diffusers orders its input columns differently; the other hosts suffice
        a, b = tensors[f"{host}.lora_A.weight"].double(), tensors[f"{host}.lora_B.weight"].double()
        out[host] = (_host_base(tensors, host).double(), (ALPHA / RANK) * (b @ a))
    return out


def test_merged_export_keeps_the_trained_update_within_fp32_rounding(lora_checkpoint, tmp_path):
    tensors = model_tensors(lora_checkpoint)
    assert tensors["transformer_blocks.0.attn.to_qkv.weight"].dtype == torch.bfloat16
    dst = tmp_path / "fp32"
    assert convert(["mcore-to-diffusers", "--src", str(lora_checkpoint), "--dst", str(dst), "--dtype", "float32"]) == 0
    exported = load_file(str(dst / "diffusion_pytorch_model.safetensors"))
    expected = _merged_in_test(tensors)
    assert len(expected) >= 12
    for host, (base, delta) in expected.items():
        got = exported[f"{host}.weight"]
        assert got.dtype == torch.float32
        assert float(delta.abs().max()) > 0, host  # two steps trained the adapter
        # Within float32 rounding of W + delta ...
        torch.testing.assert_close(got.double(), base + delta, rtol=2 ** -23, atol=1e-9, msg=host)
        # ... so the trained update survives whole (a bf16 rounding of the sum loses a large share of it).
        kept = got.double() - base
        assert float((kept - delta).norm() / delta.norm()) < 1e-3, host


def test_default_export_is_in_the_master_dtype_with_the_umask_mode(lora_checkpoint, tmp_path):
    dst = tmp_path / "default"
    old = os.umask(0o027)
    try:
        assert convert(["mcore-to-diffusers", "--src", str(lora_checkpoint), "--dst", str(dst)]) == 0
    finally:
        os.umask(old)
    weights = dst / "diffusion_pytorch_model.safetensors"
    exported = load_file(str(weights))
    assert {v.dtype for v in exported.values()} == {torch.float32}  # the adapters' (master) dtype, merged once
    assert weights.stat().st_mode & 0o777 == 0o640
    keep = tmp_path / "keep"
    old = os.umask(0o002)
    try:
        assert convert(["mcore-to-diffusers", "--src", str(lora_checkpoint), "--dst", str(keep), "--keep-lora"]) == 0
    finally:
        os.umask(old)
    assert (keep / "pytorch_lora_weights.safetensors").stat().st_mode & 0o777 == 0o664


def test_the_lora_extra_installs_peft():
    text = (ROOT / "setup.py").read_text()
    assert re.search(r'"lora":\s*\["peft[^"]*"\]', text)
