"""Wan at tensor-parallel sizes 2 and 4 (4 gloo ranks) equals TP=1 (which tests/unit/test_wan_model.py holds
to diffusers' WanTransformer3DModel): forward output and every parameter gradient, < 1e-5 relative; checkpoints
reshard between TP=1 and TP=2/4 in both directions."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

SEED = 3
# 8 heads of 6 (hidden 48) and 48 MLP units: TP=4 leaves 2 heads and 12 units per rank, so the q/k RMSNorm
# statistic spans every rank's heads and each rank's slice holds more than one head.
ARCH = {"num_attention_heads": 8, "attention_head_dim": 6, "ffn_dim": 48}
HIDDEN = 48
TP_SIZES = (2, 4)


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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _at_tp(tp: int, root: str, ref_out, ref_grads) -> dict:
    """This rank's errors at TP size ``tp`` against TP=1 (megatron's TP groups initialised)."""
    from leangrpo_mcore.models import load_policy, save_policy

    model = _build(SEED)  # the same weights at every TP size, this rank's slices of them
    layer = model.layers[0]
    rows = (layer.attn1.to_qkv.weight.shape[0], layer.attn2.to_kv.weight.shape[0],
            model.condition_embedder.time_proj.weight.shape[0])
    out, grads = _forward_backward(model)
    latents, timestep, text = _inputs()[:3]
    with torch.no_grad():  # saved at TP=1 in our format, loaded at this TP size
        loaded_out = load_policy(f"{root}/tp1", backend="local")(latents, timestep, text)
    save_policy(model, f"{root}/tp{tp}")  # read back at TP=1 by the test
    assert set(grads) == set(ref_grads)
    return {"out": _rel(out, ref_out), "grad": max(_rel(grads[n], ref_grads[n]) for n in grads),
            "worst": max(grads, key=lambda n: _rel(grads[n], ref_grads[n])),
            "shapes": all(grads[n].shape == ref_grads[n].shape for n in grads), "rows": rows,
            "loaded": _rel(loaded_out, ref_out)}


def _compare(rank: int, world_size: int, root: str, ref_out, ref_grads):
    from megatron.core import parallel_state

    results = {}
    for tp in TP_SIZES:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            results[tp] = _at_tp(tp, root, ref_out, ref_grads)
        finally:
            parallel_state.destroy_model_parallel()
    return results


def test_tp_2_and_4_equal_tp1_forward_gradients_and_checkpoints(tmp_path):
    from leangrpo_mcore.models import load_policy, save_policy

    reference = _build(SEED)
    save_policy(reference, tmp_path / "tp1")
    ref_out, ref_grads = _forward_backward(reference)
    # Results travel as plain floats and tuples: a torch tensor crosses the result queue as a shared-memory
    # handle served by the rank, which may have exited by the time the parent unpickles it.
    results = run_ranks(_compare, 4, str(tmp_path), ref_out, ref_grads, timeout=240)
    for rank_result in results:
        assert sorted(rank_result) == [2, 4]
        for tp, r in rank_result.items():
            # fused q/k/v, fused cross-attention k/v and the adaLN projection are split over the TP ranks
            assert r["rows"] == (3 * HIDDEN // tp, 2 * HIDDEN // tp, 6 * HIDDEN // tp), tp
            assert r["shapes"], tp
            assert r["out"] <= 1e-5 and r["grad"] <= 1e-5, (tp, r)
            assert r["loaded"] <= 1e-5, (tp, r)  # saved at TP=1, loaded at TP=tp
    for tp in TP_SIZES:  # saved at TP=tp (gathered), loaded at TP=1: the same weights as the seeded model
        reloaded = dict(load_policy(tmp_path / f"tp{tp}", backend="local").named_parameters())
        assert all(torch.equal(reloaded[name], p) for name, p in reference.named_parameters()), tp
