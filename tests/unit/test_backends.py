"""Backend choice, the local layers, norms, RoPE, TP-invariant init and TP slicing helpers (TP=1, CPU)."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from leangrpo_mcore.models import backends
from leangrpo_mcore.models.common import checkpoint as ckpt
from leangrpo_mcore.models.common.fp8 import FP8Contexts, fp8_config
from leangrpo_mcore.models.common.init import init_parameters
from leangrpo_mcore.models.common.norms import RMSNorm, TPRMSNorm
from leangrpo_mcore.models.common.rope import apply_rotary, multi_axis_rope_cos_sin
from leangrpo_mcore.models.common.tp import full_shape, mark_tp_partitioned, shard_range, shard_tensor

CONFIG = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                           gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)


def test_backend_resolution_without_transformer_engine(monkeypatch, tmp_path):
    broken = tmp_path / "transformer_engine"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    backends._import_te.cache_clear()
    try:
        assert not backends.te_available()
        assert backends.resolve_backend("auto") == "local"
        assert isinstance(backends.get_backend(), backends.LocalBackend)
        with pytest.raises(ValueError, match="Transformer Engine"):
            backends.resolve_backend("te")
        with pytest.raises(ValueError, match="unknown backend"):
            backends.resolve_backend("apex")
    finally:
        backends._import_te.cache_clear()


def test_local_linears_return_tensors_with_stable_names():
    provider = backends.get_backend("local")
    layers = {"column": provider.column_parallel_linear(32, 48, config=CONFIG),
              "row": provider.row_parallel_linear(32, 48, config=CONFIG),
              "replicated": provider.replicated_linear(32, 48, config=CONFIG, bias=False)}
    x = torch.randn(2, 3, 5, 32)
    for mode, layer in layers.items():
        init_parameters(layer, seed=0)
        assert layer.parallel_mode == mode and (layer.full_in_features, layer.full_out_features) == (32, 48)
        out = layer(x)
        assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 5, 48)
        assert torch.allclose(out, F.linear(x, layer.weight, layer.bias), atol=1e-6)
    assert [n for n, _ in layers["column"].named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in layers["replicated"].named_parameters()] == ["weight"]
    assert layers["column"].weight.partition_dim == 0 and layers["row"].weight.partition_dim == 1


def test_core_attention_matches_softmax_reference():
    attention = backends.get_backend("local").core_attention(config=CONFIG)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 2, 16, generator=gen) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, :, :, 3:] = False
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(16)
    scores = scores.masked_fill(~mask, float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).flatten(2)
    assert torch.allclose(attention(q, k, v, attn_mask=mask), expected, atol=1e-5)
    assert attention(q, k, v).shape == (2, 5, 32)


def test_norms_and_rope_match_references():
    from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed

    x = torch.randn(3, 7, 24)
    for norm in (RMSNorm(24, 1e-6), TPRMSNorm(24, 1e-6)):
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        reference = torch.nn.RMSNorm(24, eps=1e-6)
        reference.weight.data.copy_(norm.weight)
        assert torch.allclose(norm(x), reference(x), atol=1e-6)
    ids = torch.stack([torch.zeros(9), torch.arange(9.0) // 3, torch.arange(9.0) % 3], dim=1)
    cos, sin = multi_axis_rope_cos_sin(ids, (4, 6, 6), 10000.0)
    tables = [get_1d_rotary_pos_embed(d, ids[:, i], theta=10000, use_real=True, repeat_interleave_real=True,
                                      freqs_dtype=torch.float64) for i, d in enumerate((4, 6, 6))]
    assert torch.allclose(cos, torch.cat([t[0] for t in tables], -1)) and cos.dtype == torch.float32
    heads = torch.randn(2, 9, 3, 16)
    expected = apply_rotary_emb(heads, (cos, sin), sequence_dim=1)
    assert torch.allclose(apply_rotary(heads, cos, sin), expected, atol=1e-6)
    assert torch.allclose(apply_rotary(heads, cos, sin).norm(dim=-1), heads.norm(dim=-1), atol=1e-5)


def test_partition_is_one_contiguous_slice_per_rank():
    param = torch.nn.Parameter(torch.empty(4, 5))  # a rank's shard of a (4, 10) weight at TP=2
    mark_tp_partitioned(param, 1)
    full = torch.arange(40.0).view(4, 10)
    assert full_shape(param, world_size=2) == (4, 10)
    assert torch.equal(shard_tensor(full, param, rank=1, world_size=2), full[:, 5:])
    assert shard_range(param, 10, rank=1, world_size=2) == (5, 10)
    source = ckpt.MemorySource({"w": full})
    assert torch.equal(source.get_shard("w", param), full)  # TP=1 here: the whole tensor


def test_init_is_seeded_per_parameter_name():
    provider = backends.get_backend("local")
    a = torch.nn.ModuleDict({"x": provider.column_parallel_linear(8, 8, config=CONFIG),
                             "y": provider.replicated_linear(8, 8, config=CONFIG)})
    b = torch.nn.ModuleDict({"y": provider.replicated_linear(8, 8, config=CONFIG)})
    init_parameters(a, seed=5)
    init_parameters(b, seed=5)
    assert torch.equal(a["y"].weight, b["y"].weight)  # construction order and siblings do not matter
    assert not torch.equal(a["x"].weight, a["y"].weight)
    assert a["y"].weight.abs().max() <= 1 / math.sqrt(8)


def test_fp8_settings_and_disabled_contexts():
    config = fp8_config(CONFIG, "tensorwise")
    assert (config.fp8, config.fp8_recipe) == ("hybrid", "tensorwise")
    assert fp8_config(config, None).fp8 is None
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        fp8_config(CONFIG, "fp4")
    contexts = FP8Contexts(torch.nn.Linear(2, 2), CONFIG)
    assert not contexts.enabled
    with contexts.rollout():
        with pytest.raises(ValueError, match="inside phase"):
            with contexts.training():
                pass


def test_every_optimizer_step_invalidates_cached_fp8_weights():
    import torch

    from leangrpo_mcore.engine.optim import optimizer_step
    from leangrpo_mcore.models.backends import weights_version

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    before = weights_version()
    for expected in (1, 2):
        param.grad = torch.ones(2)
        optimizer_step(optimizer, [param])
        assert weights_version() == before + expected
