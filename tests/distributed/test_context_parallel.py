"""Context parallelism (Ulysses) on 2 gloo ranks: the FLUX and Wan forwards at cp=2 equal cp=1, and so does the
sum of the CP ranks' parameter gradients; token counts that cp does not divide (uneven pieces) included."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

FLUX_ARCH = {"family": "flux", "preset": "tiny"}
WAN_ARCH = {"family": "wan", "preset": "tiny"}


def _flux_inputs():
    gen = torch.Generator().manual_seed(7)
    batch, img, txt = 2, 16, 5  # 5 text tokens: pieces of 3 and 2
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 4, torch.arange(img) % 4], dim=1)
    return dict(hidden_states=torch.randn(batch, img, 16, generator=gen),
                encoder_hidden_states=torch.randn(batch, txt, 32, generator=gen),
                pooled_projections=torch.randn(batch, 24, generator=gen),
                timestep=torch.rand(batch, generator=gen), img_ids=img_ids, txt_ids=torch.zeros(txt, 3),
                guidance=torch.full((batch,), 3.5))


def _wan_inputs(per_token: bool):
    gen = torch.Generator().manual_seed(11)
    latents = torch.randn(2, 4, 3, 2, 6, generator=gen)  # a 3 x 1 x 3 patch grid: 9 tokens, pieces of 5 and 4
    timestep = torch.rand(2, 9, generator=gen) * 1000 if per_token else torch.tensor([870.0, 125.0])
    return dict(hidden_states=latents, timestep=timestep, encoder_hidden_states=torch.randn(2, 5, 16, generator=gen))


def _forward_backward(arch: dict, inputs: dict, parts: int, lora: bool = False):
    """Output and parameter gradients; under CP each rank's loss is 1/cp of the (replicated) loss and the
    gradients are summed over the CP group, which must give the cp=1 gradient."""
    import torch.distributed as dist

    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy
    from leangrpo_mcore.models.common.context_parallel import cp_group
    from leangrpo_mcore.models.common.tp import gather_tensor

    model = build_policy(arch, seed=3, backend="local")
    if lora:
        apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=("to_q", "to_v")), seed=5)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.linspace(-0.5, 0.5, param.numel()).view_as(param))
    out = model(**inputs)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    ((out * weights).sum() / parts).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if cp_group() is not None:
            dist.all_reduce(grad, group=cp_group())
        grads[name] = gather_tensor(grad, param).numpy()
    return out.detach().numpy(), grads


def _cases():
    return {"flux": (FLUX_ARCH, _flux_inputs(), False), "flux_lora": (FLUX_ARCH, _flux_inputs(), True),
            "wan": (WAN_ARCH, _wan_inputs(False), False), "wan_per_token": (WAN_ARCH, _wan_inputs(True), False),
            "wan_checkpointed": ({**WAN_ARCH, "activation_checkpointing": True}, _wan_inputs(False), False)}


def _cp_rank(rank: int, world_size: int):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        return {name: _forward_backward(arch, inputs, world_size, lora)
                for name, (arch, inputs, lora) in _cases().items()}
    finally:
        parallel_state.destroy_model_parallel()


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_cp2_forward_and_gradients_equal_cp1():
    reference = {name: _forward_backward(arch, inputs, 1, lora) for name, (arch, inputs, lora) in _cases().items()}
    ranks = run_ranks(_cp_rank, 2, timeout=180)
    for out in ranks:
        for name, (ref_out, ref_grads) in reference.items():
            got_out, got_grads = out[name]
            assert _rel(got_out, ref_out) <= 1e-5, name
            assert sorted(got_grads) == sorted(ref_grads)
            for param, grad in got_grads.items():
                assert abs(ref_grads[param]).max() > 0 or "lora_A" in param, (name, param)
                assert _rel(grad, ref_grads[param]) <= 1e-5, (name, param)
