"""Transformer Engine backend and FP8 contexts (needs CUDA and an importable TE; skipped otherwise)."""

import pytest
import torch

from leangrpo_mcore.models import build_policy
from leangrpo_mcore.models.backends import te_available
from leangrpo_mcore.models.common.fp8 import FP8Contexts, fp8_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not te_available(), reason="needs Transformer Engine")]

# FP8 GEMMs need 16-aligned widths: every channel count here is a multiple of 16.
TINY = {"family": "flux", "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
        "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}


def _inputs(scale: float = 1.0):
    gen = torch.Generator().manual_seed(0)
    img, txt = 16, 16
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 4, torch.arange(img) % 4], dim=1)
    data = dict(hidden_states=scale * torch.randn(2, img, 16, generator=gen),
                encoder_hidden_states=torch.randn(2, txt, 32, generator=gen),
                pooled_projections=torch.randn(2, 32, generator=gen), timestep=torch.rand(2, generator=gen),
                img_ids=img_ids, txt_ids=torch.zeros(txt, 3), guidance=torch.full((2,), 3.5))
    return {k: v.cuda() for k, v in data.items()}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_te_backend_matches_local_backend_with_the_same_names():
    local = build_policy(TINY, seed=0, backend="local", dtype=torch.bfloat16).cuda()
    te_model = build_policy(TINY, seed=0, backend="te", dtype=torch.bfloat16)
    assert [n for n, _ in local.named_parameters()] == [n for n, _ in te_model.named_parameters()]
    with torch.no_grad():
        assert _rel(te_model(**_inputs()), local(**_inputs())) < 2e-2


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_fp8_rollout_and_training_forwards_agree(recipe):
    # Current scaling keeps no history: a no-grad rollout forward and a training forward of the same input
    # quantise alike, so the rollout-vs-training ratio stays inside a 1e-4 clip range.
    model = build_policy(TINY, seed=0, backend="te", dtype=torch.bfloat16)
    model.config = fp8_config(model.config, recipe)
    contexts = FP8Contexts(model)
    with torch.no_grad(), contexts.rollout():
        for _ in range(3):
            model(**_inputs(scale=100.0))  # other activation statistics must not leak into later forwards
        rollout = model(**_inputs())
    with contexts.training():
        training = model(**_inputs())
    assert _rel(training.detach(), rollout) < 1e-4
    with torch.no_grad():
        reference = build_policy(TINY, seed=0, backend="te", dtype=torch.bfloat16)(**_inputs())
    assert _rel(rollout, reference) < 0.1