"""Wan at tensor-parallel size 2 (2 gloo ranks) equals TP=1: forward output and every parameter gradient;
checkpoints reshard between TP=1 and TP=2 in both directions."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

SEED = 3
# 4 heads so that each of the 2 ranks holds 2: the q/k RMSNorm statistic must span both ranks' heads.
ARCH = {"num_attention_heads": 4, "attention_head_dim": 6, "ffn_dim": 24}


def _build(seed: int):
    from leangrpo_mcore.models import build_policy

    return build_policy({"preset": "tiny", **ARCH}, seed=seed, backend="local")


def _inputs():
    gen = torch.Generator().manual_seed(11)
    latents = torch.randn(2, 4, 3, 4, 6, generator=gen)
    timestep = torch.tensor([870.0, 125.0])
    text = torch.randn(2, 5, 16, generator=gen)
    probe = torch.randn(2, 4, 3, 4, 6, generator=gen)
    return latents, timestep, text, probe


def _forward_backward(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from leangrpo_mcore.models.common.tp import gather_tensor

    latents, timestep, text, probe = _inputs()
    out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text)
    (out * probe).sum().backward()
    grads = {name: gather_tensor(p.grad, p) for name, p in model.named_parameters()}
    return out.detach(), grads


def _tp2_rank(rank: int, world_size: int, tp1_dir: str, tp2_dir: str):
    # Results travel as numpy arrays: a torch tensor crosses the result queue as a shared-memory handle
    # served by this process, which may have exited by the time the parent unpickles it.
    from megatron.core import parallel_state

    from leangrpo_mcore.models import load_policy, save_policy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model = _build(SEED)
        local_q = (model.layers[0].attn1.to_qkv.weight.shape[0], model.layers[0].attn2.to_kv.weight.shape[0],
                   model.condition_embedder.time_proj.weight.shape[0])
        out, grads = _forward_backward(model)
        save_policy(model, tp2_dir)
        latents, timestep, text = _inputs()[:3]
        with torch.no_grad():
            loaded_out = load_policy(tp1_dir, backend="local")(latents, timestep, text)
        return out.numpy(), {n: g.numpy() for n, g in grads.items()}, local_q, loaded_out.numpy()
    finally:
        parallel_state.destroy_model_parallel()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def test_tp2_equals_tp1_forward_gradients_and_checkpoints(tmp_path):
    from leangrpo_mcore.models import load_policy, save_policy

    reference = _build(SEED)
    save_policy(reference, tmp_path / "tp1")
    ref_out, ref_grads = _forward_backward(reference)
    results = run_ranks(_tp2_rank, 2, str(tmp_path / "tp1"), str(tmp_path / "tp2"), timeout=180)
    for out, grads, local_q, loaded_out in results:
        out, loaded_out = torch.from_numpy(out), torch.from_numpy(loaded_out)
        grads = {name: torch.from_numpy(g) for name, g in grads.items()}
        assert local_q == (36, 24, 72)  # fused q/k/v, fused k/v and the adaLN projection, split over 2 ranks
        assert _rel(out, ref_out) <= 1e-5
        assert _rel(loaded_out, ref_out) <= 1e-5  # saved at TP=1, loaded at TP=2
        assert sorted(grads) == sorted(ref_grads)
        for name, grad in grads.items():
            assert grad.shape == ref_grads[name].shape, name
            assert _rel(grad, ref_grads[name]) <= 1e-5, name
    # Saved at TP=2 (gathered), loaded at TP=1: the same weights as the seeded TP=1 model.
    reloaded = dict(load_policy(tmp_path / "tp2", backend="local").named_parameters())
    assert all(torch.equal(reloaded[name], p) for name, p in reference.named_parameters())
