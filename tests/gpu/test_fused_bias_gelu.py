"""megatron-core's fused bias + tanh-GELU, the path of column-parallel MLP inputs at TP > 1 on CUDA (skipped
without CUDA): same values and gradients as the eager formula the CPU runs."""

import pytest
import torch
import torch.nn.functional as F

from leangrpo_mcore.models.backends import activate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_fused_bias_gelu_matches_the_eager_formula():
    gen = torch.Generator().manual_seed(0)
    out = (3 * torch.randn(64, 48, generator=gen)).cuda().requires_grad_(True)
    bias = torch.randn(48, generator=gen).cuda().requires_grad_(True)
    probe = torch.randn(64, 48, generator=gen).cuda()
    results = []
    for fused in (True, False):
        value = activate(out, "gelu_tanh", bias) if fused else F.gelu(out + bias, approximate="tanh")
        grads = torch.autograd.grad((value * probe).sum(), (out, bias))
        results.append((value.detach(), *grads))
    for got, expected in zip(*results):
        assert got.shape == expected.shape
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
