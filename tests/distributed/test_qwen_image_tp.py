"""Qwen-Image at TP=1 and 2, and at CP=2 (2 gloo ranks), against diffusers' QwenImageTransformer2DModel on the
same weights with padded text: forward output and every gradient (mapped to diffusers' names through the
conversion plan), plus LoRA adapters on the published targets at TP=2 and CP=2 against TP=1."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

# 4 heads of 8 channels (whole heads per rank at TP 2 and CP 2), two blocks.
TINY = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 4, "joint_attention_dim": 24, "guidance_embeds": False, "axes_dims_rope": [2, 2, 4]}
GRID = (1, 5, 3)


def _inputs():
    gen = torch.Generator().manual_seed(7)
    batch, text_len = 2, 7
    # 15 image tokens and 7 text tokens split unevenly over CP ranks; the second prompt has 4 real tokens, so
    # rank 1's text piece is all padding for it.
    mask = (torch.arange(text_len)[None, :] < torch.tensor([[7], [4]])).long()
    return dict(hidden_states=torch.randn(batch, 15, 64, generator=gen),
                encoder_hidden_states=torch.randn(batch, text_len, 24, generator=gen),
                encoder_hidden_states_mask=mask, timestep=torch.rand(batch, generator=gen),
                img_shapes=[[GRID]] * batch)


def _probe(out: torch.Tensor) -> torch.Tensor:
    # A loss that weighs each output element differently catches permuted or partial gradients.
    return torch.linspace(-1, 1, out.numel()).view_as(out)


def _diffusers_reference(folder):
    """Save a random diffusers Qwen-Image at ``folder``; return its output and gradients on ``_inputs()``."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**TINY)
    with torch.no_grad():  # default init leaves the norms at one and the adaLN gates at zero
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))
    model.save_pretrained(str(folder))
    out = model(**_inputs(), return_dict=False)[0]
    (out * _probe(out)).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _forward_backward(model, cp_sum: bool = False):
    import torch.distributed as dist

    from leangrpo_mcore.models.common.tp import gather_tensor

    out = model(**_inputs())
    (out * _probe(out)).sum().backward()
    grads = {n: gather_tensor(p.grad, p) for n, p in model.named_parameters() if p.grad is not None}
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

    model = build_policy({"family": "qwen_image", **TINY, "activation_checkpointing": True}, seed=3)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=get_family("qwen_image").lora_targets), seed=5)
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
            plan = get_family("qwen_image").diffusers_plan(model.config)
            grads = get_family("qwen_image").mcore_to_diffusers(
                {n: grads.get(n, torch.zeros(plan[n].full_shape)) for n in plan}, model.config)
            rows = (model.transformer_blocks[0].attn.to_qkv.weight.shape[0],
                    model.transformer_blocks[0].img_mod[1].weight.shape[0])
            l_out, l_grads = _forward_backward(_lora_policy(), cp_sum=cp > 1)
        finally:
            parallel_state.destroy_model_parallel()
        assert set(l_grads) == set(lora_grads)
        results[(tp, cp)] = {
            "out": _rel(out, ref_out), "grad": max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
            "dead": sorted(n for n in grads if n not in ref_grads and grads[n].abs().max() > 0), "rows": rows,
            "lora_out": _rel(l_out, lora_out), "lora_grad": max(_rel(l_grads[n], lora_grads[n]) for n in l_grads),
            "lora_count": sum(".lora_" in n for n in l_grads)}
    return results


def test_tp_and_cp_match_diffusers_forward_and_gradients(tmp_path):
    ref_out, ref_grads = _diffusers_reference(tmp_path / "diffusers")
    results = run_ranks(_compare, 2, str(tmp_path / "diffusers"), ref_out, ref_grads, timeout=240)
    for rank_result in results:
        for (tp, cp), r in rank_result.items():
            assert r["rows"] == (3 * 32 // tp, 6 * 32 // tp), tp  # fused q/k/v and the 6-way modulation are sharded
            assert r["out"] < 1e-5 and r["grad"] < 3e-5 and not r["dead"], (tp, cp, r)
            assert r["lora_out"] < 1e-5 and r["lora_grad"] < 1e-5, (tp, cp, r)
            # A and B of 2 blocks x 12 targets, less the last block's to_add_out and text MLP (they feed nothing)
            assert r["lora_count"] == 2 * (2 * 12 - 3)
