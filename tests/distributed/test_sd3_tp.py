"""SD3 at TP=1 and 2, and at CP=2 (2 gloo ranks), against diffusers' SD3Transformer2DModel on the same weights:
forward output and every gradient (mapped to diffusers' names through the conversion plan), plus LoRA adapters on
the FlowGRPO targets at TP=2 against TP=1."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

# 4 heads; dual attention in blocks 0 and 1, block 2 context-pre-only.
TINY = {"sample_size": 8, "patch_size": 2, "in_channels": 16, "num_layers": 3, "attention_head_dim": 8,
        "num_attention_heads": 4, "joint_attention_dim": 24, "caption_projection_dim": 32,
        "pooled_projection_dim": 20, "out_channels": 16, "pos_embed_max_size": 16, "dual_attention_layers": [0, 1],
        "qk_norm": "rms_norm"}


def _inputs():
    gen = torch.Generator().manual_seed(7)
    batch = 2
    # 5 x 3 = 15 image tokens and 7 text tokens: odd counts split unevenly over CP ranks.
    return dict(hidden_states=torch.randn(batch, 16, 10, 6, generator=gen),
                encoder_hidden_states=torch.randn(batch, 7, 24, generator=gen),
                pooled_projections=torch.randn(batch, 20, generator=gen),
                timestep=torch.rand(batch, generator=gen) * 1000)


def _probe(out: torch.Tensor) -> torch.Tensor:
    # A loss that weighs each output element differently catches permuted or partial gradients.
    return torch.linspace(-1, 1, out.numel()).view_as(out)


def _diffusers_reference(folder):
    """Save a random diffusers SD3 at ``folder``; return its output and gradients on ``_inputs()``."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**TINY)
    with torch.no_grad():  # default init leaves the norms at one and the adaLN-zero gates at zero
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))
    model.save_pretrained(str(folder))
    out = model(**_inputs(), return_dict=False)[0]
    (out * _probe(out)).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


def _forward_backward(model, cp_sum: bool = False):
    import torch.distributed as dist

    from leangrpo_mcore.models.common.tp import gather_tensor

    out = model(**_inputs())
    (out * _probe(out)).sum().backward()
    grads = {n: gather_tensor(p.grad, p) for n, p in model.named_parameters()}
    if cp_sum:
        # Every CP rank computes the same loss on the gathered output; the sum of the ranks' partial gradients is
        # the gradient of the sum of their losses (context_parallel's module doc): cp times the one loss's.
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
            grad /= dist.get_world_size(group)
    return out.detach(), grads


def _lora_policy():
    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, get_family
    from leangrpo_mcore.models.common.tp import full_shape, shard_tensor

    model = build_policy({"family": "sd3", **TINY, "activation_checkpointing": True}, seed=3)
    # + the MLPs (column / row) and attn2's projections
    targets = get_family("sd3").lora_targets + ("ff.net.0.proj", "ff.net.2", "attn2.to_q", "attn2.to_out.0")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=targets), seed=5)
    with torch.no_grad():  # non-zero B so that the adapters contribute and get full gradients
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                shape = full_shape(param)
                param.copy_(shard_tensor(torch.linspace(-0.5, 0.5, shape.numel()).view(shape), param))
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # Norm-relative: a replicated q/k-norm weight's gradient is a sum over heads, tokens and samples whose order
    # changes with TP; a wrong shard or a missing head shows up as an error of order one.
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _compare(rank, world_size, folder, ref_out, ref_grads):
    from megatron.core import parallel_state

    from leangrpo_mcore.models import get_family, load_policy

    results = {}
    lora_out, lora_grads = _forward_backward(_lora_policy())  # TP=1: parallel_state not initialised yet
    for tp, cp in ((1, 1), (2, 1), (1, 2)):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            model = load_policy(folder, backend="local")  # this rank's slices of the diffusers files
            out, grads = _forward_backward(model, cp_sum=cp > 1)
            grads = get_family("sd3").mcore_to_diffusers(grads, model.config)
            grads.pop("pos_embed.pos_embed")
            rows = (model.transformer_blocks[0].attn.to_qkv.weight.shape[0],
                    model.transformer_blocks[0].norm1.linear.weight.shape[0])
            l_out, l_grads = _forward_backward(_lora_policy(), cp_sum=cp > 1)
        finally:
            parallel_state.destroy_model_parallel()
        assert set(grads) == set(ref_grads) and set(l_grads) == set(lora_grads)
        results[(tp, cp)] = {
            "out": _rel(out, ref_out), "grad": max(_rel(grads[n], ref_grads[n]) for n in grads), "rows": rows,
            "lora_out": _rel(l_out, lora_out), "lora_grad": max(_rel(l_grads[n], lora_grads[n]) for n in l_grads),
            "lora_count": sum(".lora_" in n for n in l_grads)}
    return results


def test_tp_and_cp_match_diffusers_forward_and_gradients(tmp_path):
    ref_out, ref_grads = _diffusers_reference(tmp_path / "diffusers")
    results = run_ranks(_compare, 2, str(tmp_path / "diffusers"), ref_out, ref_grads, timeout=240)
    for rank_result in results:
        for (tp, cp), r in rank_result.items():
            assert r["rows"] == (3 * 32 // tp, 9 * 32 // tp), tp  # fused q/k/v and the 9-way adaLN are sharded
            # diffusers' own fp32 gradients sit up to 6e-6 from float64 ones (attn2's q/k-norm weights), so two
            # fp32 orders of summation may differ by twice that.
            assert r["out"] < 1e-5 and r["grad"] < 3e-5, (tp, cp, r)
            assert r["lora_out"] < 1e-5 and r["lora_grad"] < 1e-5, (tp, cp, r)
            # A and B of: 3 x 7 joint projections + 2 to_add_out + 3 x 2 MLP linears + 2 x 2 attn2 projections
            assert r["lora_count"] == 2 * (21 + 2 + 6 + 4)
