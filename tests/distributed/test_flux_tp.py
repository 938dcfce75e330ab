"""FLUX at TP=2 (2 gloo ranks) equals TP=1: forward output and every gradient, with and without LoRA."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

TINY = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 24, "guidance_embeds": True,
        "axes_dims_rope": [4, 6, 6]}


def _inputs():
    gen = torch.Generator().manual_seed(7)
    batch, img, txt = 2, 16, 8
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 4, torch.arange(img) % 4], dim=1)
    return dict(hidden_states=torch.randn(batch, img, 16, generator=gen),
                encoder_hidden_states=torch.randn(batch, txt, 32, generator=gen),
                pooled_projections=torch.randn(batch, 24, generator=gen),
                timestep=torch.rand(batch, generator=gen), img_ids=img_ids, txt_ids=torch.zeros(txt, 3),
                guidance=torch.full((batch,), 3.5))


def _run(lora: bool):
    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, get_family
    from leangrpo_mcore.models.common.tp import full_shape, gather_tensor, shard_tensor

    config = {"family": "flux", **TINY, "activation_checkpointing": lora}
    model = build_policy(config, seed=3)
    if lora:
        targets = get_family("flux").lora_targets + ("proj_mlp", "proj_out")  # + segmented row, replicated
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=targets), seed=5)
        with torch.no_grad():  # non-zero B so that the adapters contribute and get full gradients
            for name, param in model.named_parameters():
                if name.endswith("lora_B.weight"):
                    shape = full_shape(param)
                    param.copy_(shard_tensor(torch.linspace(-0.5, 0.5, shape.numel()).view(shape), param))
    inputs = _inputs()
    out = model(**inputs)
    # A loss that weighs each output element differently catches permuted or partial gradients.
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weights).sum().backward()
    grads = {n: gather_tensor(p.grad, p) for n, p in model.named_parameters()}
    return out.detach(), grads


def _tp_rms_norm(x_full: torch.Tensor, weights: torch.Tensor):
    """TPRMSNorm on this rank's channel slice; returns (output, input grad, weight grad) slices."""
    from leangrpo_mcore.models.common.norms import TPRMSNorm
    from leangrpo_mcore.models.common.tp import shard_tensor, tp_rank, tp_world_size

    size, index = tp_world_size(), tp_rank()
    norm = TPRMSNorm(x_full.shape[-1])
    with torch.no_grad():
        norm.weight.copy_(shard_tensor(torch.linspace(0.5, 1.5, x_full.shape[-1]), norm.weight))
    local = x_full.chunk(size, dim=-1)[index].clone().requires_grad_(True)
    out = norm(local)
    (out * weights.chunk(size, dim=-1)[index]).sum().backward()
    return out.detach(), local.grad, norm.weight.grad


def _norm_errors():
    """TP=2 TPRMSNorm slices minus the matching slices of the TP=1 result (statistic over the full width)."""
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(1)
    x_full, weights = torch.randn(3, 5, 8, generator=gen), torch.randn(3, 5, 8, generator=gen)
    reference = _tp_rms_norm(x_full, weights)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        sharded = _tp_rms_norm(x_full, weights)
        rank = parallel_state.get_tensor_model_parallel_rank()
    finally:
        parallel_state.destroy_model_parallel()
    return [(s - r.chunk(2, dim=-1)[rank]).abs().max().item() for s, r in zip(sharded, reference)]


def _compare(rank, world_size):
    from megatron.core import parallel_state

    results = {"norm": _norm_errors()}
    for lora in (False, True):
        ref_out, ref_grads = _run(lora)  # TP=1: parallel_state not initialised yet
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            out, grads = _run(lora)
        finally:
            parallel_state.destroy_model_parallel()
        assert set(grads) == set(ref_grads)
        grad_err = max(((grads[n] - ref_grads[n]).abs().max() / (ref_grads[n].abs().max() + 1e-12)).item()
                       for n in grads)
        results[lora] = ((out - ref_out).abs().max().item() / ref_out.abs().max().item(), grad_err, len(grads))
    return results


def test_tp2_equals_tp1_forward_and_gradients():
    results = run_ranks(_compare, 2, timeout=120)
    for rank_result in results:
        assert max(rank_result.pop("norm")) < 1e-6  # output, input gradient, weight gradient
        for lora, (out_err, grad_err, count) in rank_result.items():
            assert count > 40
            assert out_err < 1e-5, (lora, out_err)
            assert grad_err < 1e-5, (lora, grad_err)
