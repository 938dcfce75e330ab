"""``grpo.kl_form=exact`` at parallel.cp=2 (2 gloo ranks) equals world size 1.

The exact KL divides by the transition std and averages over the whole sample: each CP rank holds half of every
latent, so the mean must be reduced over the pair (as the log-prob's is). Native and Reweight (which backpropagates
the KL part on its own; Retain is Native's arithmetic) on Wan with LoRA and CFG must give the world-size-1
gradient, weights after the SGD step and update loss within 1e-5 relative, and the KL term must be a real part of
that gradient.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.launcher import run_ranks
from tests.distributed.test_context_parallel_schedules import _cp_runs, _reference
from tests.unit.test_schedules_parity import Case, rel_l2
from tests.once import once_per_process

pytestmark = pytest.mark.distributed

SCHEDULES = ("native", "reweight")
WAN_EXACT = Case(family="wan", lora=True, kl_beta=20.0, kl_form="exact", group_size=2)


@pytest.fixture(scope="module")
@once_per_process
def exact_kl_runs():
    cases = {schedule: WAN_EXACT.but(schedule=schedule, cp=2) for schedule in SCHEDULES}
    without_kl = _reference({"native": WAN_EXACT.but(kl_beta=0.0)})["native"]
    return run_ranks(_cp_runs, 2, cases, timeout=300), _reference(cases), without_kl


def test_cp2_exact_kl_equals_world_size_1(exact_kl_runs):
    ranks, reference, without_kl = exact_kl_runs
    # the KL term moves the gradient: a KL averaged over half a sample would show
    assert rel_l2(reference["native"].grads[0], without_kl.grads[0]) > 0.1
    for out in ranks:
        for name, ref in reference.items():
            got = out[name]
            np.testing.assert_allclose(got.rewards, ref.rewards, rtol=1e-5, atol=1e-6)
            assert rel_l2(ref.grads[0], got.grads[0]) < 1e-5, name
            assert rel_l2(ref.params, got.params) < 1e-5, name
            assert got.losses[0] == pytest.approx(ref.losses[0], rel=1e-5, abs=1e-7), name
    assert ranks[0]["native"].losses[0] > 1e-3  # on-policy the loss is the β-weighted mean KL
    assert not np.array_equal(ranks[0]["native"].trajectory, ranks[1]["native"].trajectory)  # different halves
