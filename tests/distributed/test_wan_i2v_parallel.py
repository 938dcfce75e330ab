"""Wan image-to-video at TP 2 and CP 2 (one spawn of 2 gloo ranks) equals the single process (which
tests/unit/test_wan_i2v.py holds to diffusers): forward output and the sum of every parameter's gradient, for the
CLIP-token checkpoint (its image keys and values split over the TP ranks, its image tokens whole on the CP ranks)
and the channel-concatenated two experts (a batch whose samples run different experts); and pipeline stages
compose to the whole model, the image tokens crossing the boundary."""

import pytest
import torch

from tests.distributed.launcher import run_ranks
from tests.distributed.test_context_parallel import _forward_backward, _rel

pytestmark = pytest.mark.distributed

CLIP = {"family": "wan", "preset": "wan-tiny-i2v"}
EXPERTS = {"family": "wan", "preset": "wan-tiny-i2v-a14b"}


def _inputs(clip: bool):
    gen = torch.Generator().manual_seed(13)
    inputs = dict(hidden_states=torch.randn(2, 12, 3, 2, 6, generator=gen),  # 9 tokens: CP pieces of 5 and 4
                  timestep=torch.tensor([950.0, 125.0]), encoder_hidden_states=torch.randn(2, 5, 16, generator=gen))
    if clip:
        inputs["encoder_hidden_states_image"] = torch.randn(2, 7, 20, generator=gen)
    return inputs


def _cases():
    return {"clip": (CLIP, _inputs(True)), "experts": (EXPERTS, _inputs(False))}


def _on_ranks(rank: int, world_size: int):
    from megatron.core import parallel_state

    out = {}
    for kind, sizes in (("tp", {"tensor_model_parallel_size": 2}), ("cp", {"context_parallel_size": 2})):
        parallel_state.initialize_model_parallel(**sizes)
        try:
            parts = world_size if kind == "cp" else 1
            out[kind] = {name: _forward_backward(arch, inputs, parts) for name, (arch, inputs) in _cases().items()}
        finally:
            parallel_state.destroy_model_parallel()
    return out


def test_tp2_and_cp2_equal_one_process():
    reference = {name: _forward_backward(arch, inputs, 1) for name, (arch, inputs) in _cases().items()}
    for rank_out in run_ranks(_on_ranks, 2, timeout=240):
        for kind in ("tp", "cp"):
            for name, (ref_out, ref_grads) in reference.items():
                got_out, got_grads = rank_out[kind][name]
                assert _rel(got_out, ref_out) <= 1e-5, (kind, name)
                assert sorted(got_grads) == sorted(ref_grads)
                for param, grad in got_grads.items():
                    assert _rel(grad, ref_grads[param]) <= 1e-5, (kind, name, param)
    clip_grads = reference["clip"][1]
    assert abs(clip_grads["layers.0.attn2.to_added_kv.weight"]).max() > 0
    assert abs(clip_grads["condition_embedder.image_embedder.fc1.weight"]).max() > 0
    # each sample ran its own expert: both experts' parameters have gradients
    assert abs(reference["experts"][1]["high.layers.1.ffn.fc2.weight"]).max() > 0
    assert abs(reference["experts"][1]["low.layers.1.ffn.fc2.weight"]).max() > 0


def test_pipeline_stages_compose_with_image_tokens():
    from leangrpo_mcore.models import build_policy
    from leangrpo_mcore.models.common.pipeline import split_blocks

    for arch, clip in ((CLIP, True), (EXPERTS, False)):
        inputs = _inputs(clip)
        with torch.no_grad():
            expected = build_policy(arch, seed=3, backend="local")(**inputs)
            boundary = None
            for stage in split_blocks(2, 2):
                part = build_policy(arch, seed=3, backend="local", stage=stage)
                if boundary is not None:
                    part.set_input_tensor(boundary)
                shape = part.boundary_shape(**inputs)
                boundary = part(**inputs)
                if not stage.post_process:
                    assert tuple(boundary.shape) == shape
        assert torch.equal(boundary, expected), arch


def _schedules(rank: int, world_size: int) -> dict:
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context
    from tests.unit.test_schedules_parity import run_case
    from tests.unit.test_wan_i2v_parity import CLIP, EXPERTS, FIRST_FRAME

    out = {}
    for name, case in (("clip", CLIP), ("experts", EXPERTS), ("first_frame", FIRST_FRAME)):
        for schedule in ("native", "retain", "reweight"):  # FSDP2 over both ranks, Native synced as Retain
            out[f"{name}_{schedule}"] = run_case(case.but(schedule=schedule, sync="coalesced"))
        destroy_parallel_context()
        for schedule in ("native", "retain", "reweight"):  # the ranks as the CP ranks of each sample
            out[f"{name}_cp_{schedule}"] = run_case(case.but(schedule=schedule, sync="coalesced", cp=2))
        destroy_parallel_context()
    return out


def test_schedules_agree_with_image_conditioning_at_world_size_2_and_cp_2():
    import numpy as np

    from tests.unit.test_schedules_parity import check_parity, rel_l2, run_case
    from tests.unit.test_wan_i2v_parity import CLIP, EXPERTS, FIRST_FRAME

    ranks = run_ranks(_schedules, 2, timeout=560)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = {name: run_case(case) for name, case in (("clip", CLIP), ("experts", EXPERTS),
                                                              ("first_frame", FIRST_FRAME))}
    finally:
        torch.set_num_threads(threads)
    for out in ranks:
        for name, ref in reference.items():
            for layout in (name, f"{name}_cp"):
                native, retain, reweight = (out[f"{layout}_{s}"] for s in ("native", "retain", "reweight"))
                check_parity(native, retain, reweight, tol=3e-6)
                np.testing.assert_allclose(native.rewards, ref.rewards, rtol=1e-5, atol=1e-5)
                assert rel_l2(ref.grads[0], native.grads[0]) < 1e-5, (layout, rel_l2(ref.grads[0], native.grads[0]))
    # the shared layout splits each group: the ranks made different generations
    assert not np.array_equal(ranks[0]["clip_native"].trajectory, ranks[1]["clip_native"].trajectory)
