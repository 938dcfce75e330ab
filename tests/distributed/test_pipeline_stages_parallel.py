"""Pipeline stages on 2 gloo ranks, chained by hand. TP=2: three FLUX stages (a boundary inside the double
blocks, one at the double/single boundary) with LoRA on every kind of linear equal the whole model at TP=2 (to
1e-6) and at TP=1 (to 1e-5: TP adds in another order), output and every gradient gathered over TP. CP=2: FLUX
and Wan (per-token timesteps) stages equal the whole model at CP=2, uneven token pieces included."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

# 4 heads, so that each TP rank holds 2; 2 double + 1 single blocks, one per stage.
TINY = {"family": "flux", "patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 1,
        "attention_head_dim": 8, "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 24,
        "guidance_embeds": True, "axes_dims_rope": [2, 2, 4]}


def _policy(stage=None):
    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, get_family
    from leangrpo_mcore.models.common.tp import full_shape, shard_tensor

    model = build_policy(TINY, seed=3, backend="local", stage=stage)  # the same values at every TP size
    targets = get_family("flux").lora_targets + ("proj_mlp", "proj_out")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=targets), seed=5, require_match=stage is None)
    with torch.no_grad():  # non-zero B, the same FULL values at every TP size
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                shape = full_shape(param)
                param.copy_(shard_tensor(torch.linspace(-0.5, 0.5, shape.numel()).view(shape), param))
    return model


def _inputs():
    from tests.unit.test_flux_model import flux_inputs

    return flux_inputs(4, 4, 6)


def _gathered_grads(models):
    from leangrpo_mcore.models.common.tp import gather_tensor

    return {name: gather_tensor(p.grad, p) for model in models for name, p in model.named_parameters()}


def _rank(rank, world_size):
    from megatron.core import parallel_state

    from leangrpo_mcore.models.common.pipeline import split_blocks
    from tests.unit.test_pipeline_stages import _chain

    whole = _policy()  # TP=1: parallel_state not initialised yet
    ref = whole(**_inputs())
    probe = torch.linspace(-1, 1, ref.numel()).view_as(ref)
    torch.autograd.backward(ref, probe)
    ref_grads = _gathered_grads([whole])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        whole_tp2 = _policy()
        tp2 = whole_tp2(**_inputs())
        torch.autograd.backward(tp2, probe)
        tp2_grads = _gathered_grads([whole_tp2])
        stages = [_policy(stage) for stage in split_blocks(3, 3)]
        rows = stages[1].transformer_blocks[1].attn.to_qkv.weight.shape[0]
        out = _chain(stages, _inputs(), probe)
        grads = _gathered_grads(stages)
    finally:
        parallel_state.destroy_model_parallel()
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()  # noqa: E731
    return {"rows": rows, "names": sorted(grads) == sorted(ref_grads), "out": rel(out, ref.detach()),
            "grad": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
            "lora": sum(".lora_" in n for n in grads), "out_tp2": rel(out, tp2.detach()),
            "grad_tp2": max(rel(grads[n], tp2_grads[n]) for n in tp2_grads)}


def test_three_stages_at_tp2_equal_the_whole_model_at_tp1():
    for result in run_ranks(_rank, 2, timeout=240):
        assert result["rows"] == 3 * 32 // 2  # the stage's fused q/k/v is sharded over the 2 ranks
        assert result["names"] and result["lora"] > 30
        assert result["out"] < 1e-5 and result["grad"] < 1e-5, result  # TP changes the summation order
        assert result["out_tp2"] <= 1e-6 and result["grad_tp2"] <= 1e-6, result  # the whole model at TP=2


def _stages_against_whole(model_config, inputs, sizes):
    """(output error, largest gradient error) of the stages chained by hand against the whole model, both
    on this rank (under CP: this rank's partial gradients)."""
    from leangrpo_mcore.models import build_policy
    from leangrpo_mcore.models.common.pipeline import split_blocks
    from tests.unit.test_pipeline_stages import _chain

    whole = build_policy(model_config, seed=3, backend="local")
    ref = whole(**inputs)
    probe = torch.linspace(-1, 1, ref.numel()).view_as(ref)
    torch.autograd.backward(ref, probe)
    stages = [build_policy(model_config, seed=3, backend="local", stage=stage)
              for stage in split_blocks(whole.config.num_layers, len(sizes), sizes)]
    out = _chain(stages, inputs, probe)
    ref_grads = dict(whole.named_parameters())
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()  # noqa: E731
    return rel(out, ref.detach()), max(rel(p.grad, ref_grads[n].grad) for m in stages for n, p in m.named_parameters())


def _cp_rank(rank, world_size):
    from megatron.core import parallel_state

    from tests.distributed.test_context_parallel import _flux_inputs, _wan_inputs

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        # 5 text tokens (pieces of 3 and 2) and 16 image tokens; 9 video tokens (5 and 4) with per-token timesteps.
        return {"flux": _stages_against_whole(TINY, _flux_inputs(), (1, 1, 1)),
                "wan": _stages_against_whole({"preset": "tiny", "family": "wan"}, _wan_inputs(True), (1, 1))}
    finally:
        parallel_state.destroy_model_parallel()


def test_stages_at_cp2_equal_the_whole_model_at_cp2():
    """The boundary tensors carry this CP rank's tokens (uneven pieces included)."""
    for result in run_ranks(_cp_rank, 2, timeout=240):
        for family, (out_err, grad_err) in result.items():
            assert out_err <= 1e-6 and grad_err <= 1e-6, (family, out_err, grad_err)
