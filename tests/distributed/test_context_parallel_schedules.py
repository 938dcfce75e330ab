"""One training step at parallel.cp=2 (2 gloo ranks) and at cp=2 x tp=2 (4 ranks) equals world size 1.

Each CP rank holds half of every latent; the log-prob and KL are reduced over the pair, the rewards scored once,
and the two partial gradients summed by FSDP2. Native, Retain and Reweight must give the world-size-1 gradient
and weights after the SGD step within 1e-5 relative L2 (fp32), with the same rewards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed.launcher import run_ranks
from tests.unit.test_schedules_parity import KONTEXT, Case, bitwise, check_parity, rel_l2, run_case

pytestmark = pytest.mark.distributed

SCHEDULES = ("native", "retain", "reweight")
FLUX = Case(family="flux")
WAN_LORA_KL = Case(family="wan", lora=True, kl_beta=20.0, group_size=2)
FLUX_TP = Case(family="flux", heads=4, group_size=2, prompts=1, num_steps=3)


def _cp_runs(rank: int, world_size: int, cases: dict) -> dict:
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    out = {}
    for name, case in cases.items():
        out[name] = run_case(case)
        destroy_parallel_context()
    return out


def _reference(cases: dict) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: run_case(case.but(cp=1, tp=1)) for name, case in cases.items()}
    finally:
        torch.set_num_threads(threads)


def _check(ranks: list, reference: dict, other_cp_rank: int) -> None:
    for out in ranks:
        for name, ref in reference.items():
            got = out[name]
            np.testing.assert_allclose(got.rewards, ref.rewards, rtol=1e-5, atol=1e-6)
            assert max(float(np.abs(g).max()) for g in ref.grads[0]) > 0
            assert rel_l2(ref.grads[0], got.grads[0]) < 1e-5, name
            assert rel_l2(ref.params, got.params) < 1e-5, name
            assert abs(got.losses[0] - ref.losses[0]) <= 1e-6, name  # on-policy: the loss is ~0
            assert abs(got.grad_norms[0] - ref.grad_norms[0]) <= 1e-5 * ref.grad_norms[0], name
    # the two CP ranks hold different halves of the same samples
    first = next(iter(reference))
    assert not np.array_equal(ranks[0][first].trajectory, ranks[other_cp_rank][first].trajectory)


def test_cp2_schedules_equal_world_size_1():
    """FLUX, Wan, and FLUX.1-Kontext, whose CP pair splits the generated and the reference tokens alike (Native
    synced as Retain there: Retain bitwise Native, Reweight at the fp32 floor, at cp=2 itself too)."""
    cases = {f"{family}_{s}": case.but(schedule=s, cp=2)
             for family, case in (("flux", FLUX), ("wan", WAN_LORA_KL), ("kontext", KONTEXT.but(sync="coalesced")))
             for s in SCHEDULES}
    ranks = run_ranks(_cp_runs, 2, cases, timeout=400)
    _check(ranks, _reference(cases), other_cp_rank=1)
    for out in ranks:
        check_parity(*(out[f"kontext_{s}"] for s in SCHEDULES))
    assert bitwise(ranks[0]["kontext_retain"].params, ranks[1]["kontext_retain"].params)


def test_cp2_tp2_schedules_equal_world_size_1():
    cases = {f"flux_{s}": FLUX_TP.but(schedule=s, cp=2, tp=2) for s in SCHEDULES}
    ranks = run_ranks(_cp_runs, 4, cases, timeout=300)
    _check(ranks, _reference(cases), other_cp_rank=2)  # global ranks 0, 1 are TP peers; 2 is CP rank 1
