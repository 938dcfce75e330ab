"""FLUX at TP=1, 2 and 4 (4 gloo ranks) against diffusers' FluxTransformer2DModel on the same weights: forward
output and every gradient (mapped to diffusers' names through the conversion plan), and TP=2/4 against TP=1
with LoRA adapters on every kind of linear."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

# 4 heads, so that TP=4 leaves one head (and one run of MLP units) per rank.
TINY = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
        "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 24, "guidance_embeds": True,
        "axes_dims_rope": [2, 2, 4]}
TP_SIZES = (1, 2, 4)


def _inputs():
    gen = torch.Generator().manual_seed(7)
    batch, img, txt = 2, 16, 8
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 4, torch.arange(img) % 4], dim=1)
    return dict(hidden_states=torch.randn(batch, img, 16, generator=gen),
                encoder_hidden_states=torch.randn(batch, txt, 32, generator=gen),
                pooled_projections=torch.randn(batch, 24, generator=gen),
                timestep=torch.rand(batch, generator=gen), img_ids=img_ids, txt_ids=torch.zeros(txt, 3),
                guidance=torch.full((batch,), 3.5))


def _probe(out: torch.Tensor) -> torch.Tensor:
    # A loss that weighs each output element differently catches permuted or partial gradients.
    return torch.linspace(-1, 1, out.numel()).view_as(out)


def _diffusers_reference(folder):
    """Save a random diffusers FLUX at ``folder``; return its output and gradients on ``_inputs()``."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**TINY)
    with torch.no_grad():  # default init leaves the norms at one and the adaLN-zero gates at zero
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))
    model.save_pretrained(str(folder))
    out = model(**_inputs(), return_dict=False)[0]
    (out * _probe(out)).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


def _forward_backward(model):
    from leangrpo_mcore.models.common.tp import gather_tensor

    out = model(**_inputs())
    (out * _probe(out)).sum().backward()
    return out.detach(), {n: gather_tensor(p.grad, p) for n, p in model.named_parameters()}


def _lora_policy():
    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, get_family
    from leangrpo_mcore.models.common.tp import full_shape, shard_tensor

    model = build_policy({"family": "flux", **TINY, "activation_checkpointing": True}, seed=3)
    # + the single block's interleaved row-parallel proj_out, column proj_mlp and the replicated final proj_out
    targets = get_family("flux").lora_targets + ("proj_mlp", "proj_out")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=targets), seed=5)
    with torch.no_grad():  # non-zero B so that the adapters contribute and get full gradients
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                shape = full_shape(param)
                param.copy_(shard_tensor(torch.linspace(-0.5, 0.5, shape.numel()).view(shape), param))
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


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


def _compare(rank, world_size, folder, ref_out, ref_grads):
    from megatron.core import parallel_state

    from leangrpo_mcore.models import get_family, load_policy

    results = {"norm": _norm_errors()}
    lora_out, lora_grads = _forward_backward(_lora_policy())  # TP=1: parallel_state not initialised yet
    for tp in TP_SIZES:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            model = load_policy(folder, backend="local")  # this rank's slices of the diffusers files
            out, grads = _forward_backward(model)
            # Our gradients under diffusers' names and layouts, through the conversion plan.
            grads = get_family("flux").mcore_to_diffusers(grads, model.config)
            local_rows = model.transformer_blocks[0].attn.to_qkv.weight.shape[0]
            adaln_rows = model.transformer_blocks[0].norm1.linear.weight.shape[0]
            l_out, l_grads = _forward_backward(_lora_policy())
        finally:
            parallel_state.destroy_model_parallel()
        assert set(grads) == set(ref_grads) and set(l_grads) == set(lora_grads)
        results[tp] = {
            "out": _rel(out, ref_out), "grad": max(_rel(grads[n], ref_grads[n]) for n in grads),
            "rows": (local_rows, adaln_rows), "lora_out": _rel(l_out, lora_out),
            "lora_grad": max(_rel(l_grads[n], lora_grads[n]) for n in l_grads),
            "lora_count": sum(".lora_" in n for n in l_grads)}
    return results


def test_tp_1_2_4_match_diffusers_forward_and_gradients(tmp_path):
    ref_out, ref_grads = _diffusers_reference(tmp_path / "diffusers")
    results = run_ranks(_compare, 4, str(tmp_path / "diffusers"), ref_out, ref_grads, timeout=240)
    for rank_result in results:
        assert max(rank_result.pop("norm")) < 1e-6  # output, input gradient, weight gradient
        for tp, r in rank_result.items():
            assert r["rows"] == (3 * 32 // tp, 6 * 32 // tp), tp  # fused q/k/v and adaLN are sharded
            assert r["out"] < 1e-5 and r["grad"] < 1e-5, (tp, r)
            assert r["lora_out"] < 1e-5 and r["lora_grad"] < 1e-5, (tp, r)
            assert r["lora_count"] > 30
