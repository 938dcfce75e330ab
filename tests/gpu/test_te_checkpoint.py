"""Transformer Engine's FP8 metadata through a training checkpoint (needs CUDA and an importable TE; skipped
otherwise): a policy that ran an FP8 forward is saved, a fresh one resumes from it, and TE's extra state (the
pickled recipe and FP8 variables of every TE module) comes back equal."""

import os
import pickle

import pytest
import torch

from leangrpo_mcore.engine import checkpoint as ck
from leangrpo_mcore.engine.checkpoint.extra_state import extra_states
from leangrpo_mcore.engine.output.run_dir import RunDir
from leangrpo_mcore.models import build_policy
from leangrpo_mcore.models.backends import te_available
from leangrpo_mcore.models.common.fp8 import FP8Contexts, fp8_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not te_available(), reason="needs Transformer Engine")]

# FP8 GEMMs need 16-aligned widths (MXFP8: 32): every channel count here is a multiple of 32.
TINY = {"family": "flux", "patch_size": 1, "in_channels": 32, "num_layers": 1, "num_single_layers": 1,
        "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
        "guidance_embeds": True, "axes_dims_rope": [8, 12, 12]}


def _inputs():
    gen = torch.Generator().manual_seed(0)
    img, txt = 32, 32
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 8, torch.arange(img) % 8], dim=1)
    data = dict(hidden_states=torch.randn(2, img, 32, generator=gen),
                encoder_hidden_states=torch.randn(2, txt, 32, generator=gen),
                pooled_projections=torch.randn(2, 32, generator=gen), timestep=torch.rand(2, generator=gen),
                img_ids=img_ids, txt_ids=torch.zeros(txt, 3), guidance=torch.full((2,), 3.5))
    return {k: v.cuda() for k, v in data.items()}


def _fp8_model(recipe: str, seed: int):
    model = build_policy(TINY, seed=seed, backend="te", dtype=torch.bfloat16)
    model.config = fp8_config(model.config, recipe)
    return model


def _fp8_meta(state: torch.Tensor):
    """TE's unpickled extra state: None (or an empty tensor in some releases) until FP8 has run."""
    return pickle.loads(state.detach().cpu().numpy().tobytes()) if state.numel() else None


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_te_fp8_extra_state_is_restored_on_resume(tmp_path, recipe):
    model = _fp8_model(recipe, seed=0)
    with FP8Contexts(model).training():
        model(**_inputs()).float().square().mean().backward()
    saved = extra_states(model)
    ran = sorted(name for name, state in saved.items()
                 if isinstance(state, torch.Tensor) and _fp8_meta(state) is not None)
    assert ran, "no TE module holds FP8 metadata after an FP8 forward"

    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    layout = ck.capture_tp_layout(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    path = ck.save_checkpoint(run_dir, 1, model=model, optimizer=optimizer, lr_scheduler=None, ema=None,
                              layout=layout, state={"sampler": {}}, config_yaml="").finish()

    fresh = _fp8_model(recipe, seed=1)
    before = extra_states(fresh)
    assert all(_fp8_meta(before[name]) is None for name in ran)  # never ran under FP8: no metadata yet
    ck.load_checkpoint(path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-4),
                       lr_scheduler=None, ema=None, layout=ck.capture_tp_layout(fresh), same_layout=True,
                       warn=pytest.fail)
    restored = extra_states(fresh)
    for name in ran:
        mine, theirs = _fp8_meta(restored[name]), _fp8_meta(saved[name])
        assert mine is not None, name
        assert repr(mine["recipe"]) == repr(theirs["recipe"]), name
        for key, value in theirs["extra_fp8_variables"].items():
            assert mine["extra_fp8_variables"].get(key) == value, (name, key)
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):  # delayed scaling's scales and amax histories
                assert torch.equal(mine[key], value), (name, key)

    with torch.no_grad(), FP8Contexts(model).rollout():
        expected = model(**_inputs())
    with torch.no_grad(), FP8Contexts(fresh).rollout():
        resumed = fresh(**_inputs())
    assert torch.equal(resumed, expected)
