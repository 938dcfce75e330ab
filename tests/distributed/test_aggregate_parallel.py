"""``reward.aggregate: advantages`` on 2 gloo ranks: the (B, K) component rewards gathered per group (shared
layout), per step (conventional layout with global std), and broadcast from the scoring rank (parallel.cp=2 and
parallel.pp=2) give the world-size-1 rewards, advantages and gradients; Retain is bitwise Native (both coalesced)
and Reweight within 1e-6 relative L2 on the ranks (2e-6 in the conventional layout, whose error measures 5.1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed.launcher import run_ranks
from tests.unit.test_aggregate_advantages import WEIGHTS, reference_advantages, two_rewards
from tests.unit.test_schedules_parity import Case, check_parity, rel_l2, run_case
from tests.once import once_per_process

pytestmark = pytest.mark.distributed

SHARED = Case(family="flux", reward_weights=WEIGHTS)
CONVENTIONAL = Case(family="wan", layout="conventional", global_std=True, reward_weights=WEIGHTS)
SPLIT = {"cp": SHARED.but(cp=2, group_size=2), "pp": SHARED.but(pp=2, group_size=2)}


def _runs(rank: int, world_size: int) -> dict:
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    out = {}
    for schedule in ("native", "retain", "reweight"):  # Native coalesced as Retain, to compare them bit for bit
        out[f"shared_{schedule}"] = run_case(SHARED.but(schedule=schedule, sync="coalesced"), reward_fn=two_rewards)
    for schedule in ("native", "reweight"):
        out[f"conv_{schedule}"] = run_case(CONVENTIONAL.but(schedule=schedule, accumulate="affine"),
                                           reward_fn=two_rewards)
    destroy_parallel_context()
    for name, case in SPLIT.items():
        out[name] = run_case(case, reward_fn=two_rewards)
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
@once_per_process
def results():
    ranks = run_ranks(_runs, 2, timeout=400)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded kernels; so must the reference
    try:
        cases = {"shared": SHARED, "conv": CONVENTIONAL.but(layout="shared"),
                 **{name: case.but(cp=1, pp=1) for name, case in SPLIT.items()}}
        reference = {name: run_case(case, reward_fn=two_rewards) for name, case in cases.items()}
    finally:
        torch.set_num_threads(threads)
    return ranks, reference


def _same_step(got, ref, tolerance: float) -> None:
    np.testing.assert_array_equal(got.components, ref.components)
    np.testing.assert_array_equal(got.rewards, ref.rewards)
    np.testing.assert_allclose(got.advantages, ref.advantages, rtol=1e-6, atol=1e-6)
    assert rel_l2(ref.grads[0], got.grads[0]) < tolerance


def test_shared_layout_gathers_the_components(results):
    ranks, reference = results
    for out in ranks:
        check_parity(out["shared_native"], out["shared_retain"], out["shared_reweight"])
        _same_step(out["shared_native"], reference["shared"], 1e-6)
        expected = reference_advantages(out["shared_native"].components, WEIGHTS, clip=SHARED.adv_clip_max)
        np.testing.assert_allclose(out["shared_native"].advantages, expected, rtol=1e-5, atol=1e-6)


def test_conventional_layout_global_std_gathers_the_step(results):
    ranks, reference = results
    for out in ranks:
        _same_step(out["conv_native"], reference["conv"], 1e-6)
        assert rel_l2(out["conv_native"].grads[0], out["conv_reweight"].grads[0]) < 2e-6  # measured 5.1e-7
        expected = reference_advantages(out["conv_native"].components, WEIGHTS, global_std=True,
                                        clip=CONVENTIONAL.adv_clip_max)
        np.testing.assert_allclose(out["conv_native"].advantages, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", sorted(SPLIT))
def test_scoring_rank_broadcasts_the_components(results, split):
    ranks, reference = results
    for out in ranks:
        np.testing.assert_allclose(out[split].components, reference[split].components, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[split].advantages, reference[split].advantages, rtol=1e-4, atol=1e-5)
        whole = dict(zip(reference[split].names, reference[split].grads[0]))  # a stage holds some of them
        assert rel_l2([whole[name] for name in out[split].names], out[split].grads[0]) < 1e-5
    np.testing.assert_array_equal(ranks[0][split].components, ranks[1][split].components)
