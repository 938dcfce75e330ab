"""Wan image-to-video under the three schedules (world size 1, fp32): the conditioning image's fields ride with the
text through the rollout, the trajectories and every schedule, and Native, Retain and Reweight agree as they do
without them (Retain bitwise, Reweight at the fp32 floor), for the CLIP-token checkpoint, the channel-concatenated
two experts and Wan2.2-TI2V's first-frame conditioning."""

import numpy as np
import pytest

from tests.unit.test_schedules_parity import Case, check_parity, run_three

pytestmark = pytest.mark.slow

CLIP = Case(family="wan", image="concat", max_grad_norm=0.0)
EXPERTS = CLIP.but(experts="both")
FIRST_FRAME = Case(family="wan", image="first_frame", max_grad_norm=0.0)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.mark.parametrize("case", [CLIP, EXPERTS, FIRST_FRAME], ids=["clip", "two_experts", "first_frame"])
def test_schedules_agree_with_image_conditioning(case):
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight)
    names = dict(zip(native.names, native.grads[0]))
    if case is CLIP:  # the image tokens are part of the graph: their projections train
        assert np.abs(names["layers.0.attn2.to_added_kv.weight"]).max() > 0
        assert np.abs(names["condition_embedder.image_embedder.fc1.weight"]).max() > 0

