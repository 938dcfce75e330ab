"""Gathering the parameters once per step or per rollout (parallel.reshard_after_forward false / rollout) on 2 gloo
ranks: bitwise the same step as regathering at every forward, with the all-gathers the planner counts.

Every FSDP2 all-gather is counted at ``torch.distributed.all_gather_single`` (what FSDP2's default all-gather
calls); one gather of the model is one all-gather per FSDP unit (each block and the root).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.launcher import run_ranks
from tests.unit.test_schedules_parity import Case, bitwise, run_case
from tests.once import once_per_process

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Two prompts of 4 generations over 2 ranks: each rank rolls out 2 groups of 2 generations, T = 4, |S| = 3.
FLUX = Case(family="flux", prompts=2, group_size=4, num_steps=4)
CASES = {"native": FLUX, "retain": FLUX.but(schedule="retain"), "reweight": FLUX.but(schedule="reweight"),
         "lora_native": FLUX.but(lora=True), "lora_reweight": FLUX.but(lora=True, schedule="reweight")}
MODES = {"forward": True, "rollout": "rollout", "step": False}


def _counted(case: Case) -> tuple:
    """(the step's outcome, the all-gathers it issued)."""
    import torch.distributed as dist

    calls = []
    original = dist.all_gather_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather_single = counting
    try:
        outcome = run_case(case)
    finally:
        dist.all_gather_single = original
    return outcome, len(calls)


def _units() -> int:
    """FSDP2 units of the tiny FLUX policy: one per block, and the root."""
    from leangrpo_mcore.models import build_policy

    return len(list(build_policy({"family": "flux", "preset": "tiny"}, seed=0, backend="local").blocks())) + 1


def _all(rank: int, world_size: int) -> dict:
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    out = {}
    for name, case in CASES.items():
        for mode, value in MODES.items():
            out[name, mode] = _counted(case.but(reshard=value))
    destroy_parallel_context()
    out["units"] = _units()
    return out


@pytest.fixture(scope="module")
@once_per_process
def ranks():
    return run_ranks(_all, 2, timeout=560)


@pytest.mark.parametrize("name", list(CASES))
def test_gathering_once_is_bitwise_the_regathering_step(ranks, name):
    for out in ranks:
        regathered = out[name, "forward"][0]
        for mode in ("rollout", "step"):
            once = out[name, mode][0]
            assert np.array_equal(regathered.trajectory, once.trajectory), mode
            assert np.array_equal(regathered.rewards, once.rewards), mode
            assert all(bitwise(a, b) for a, b in zip(regathered.grads, once.grads)), mode
            assert bitwise(regathered.params, once.params), mode


@pytest.mark.parametrize("name", list(CASES))
def test_all_gathers_are_the_planners_count(ranks, name):
    """The planner's full-model gathers (``gather_cost.full_gathers``) times the FSDP2 units, counted by hand:
    T = 4 steps, |S| = 3 trained, 2 groups of 2 generations per rank at micro-batch 1 (4 micro-batches)."""
    schedule = CASES[name].schedule
    T, S, groups, micro_batches, samples = 4, 3, 2, 4, 4
    if schedule == "reweight":
        # untrained steps batched per micro-batch; each trained step one forward + one backward per sample
        forward = micro_batches * (T - S) + samples * (S + S)
        rollout = groups  # its backwards run inside the rollout
    else:
        recompute = S if schedule == "native" else 0
        forward = micro_batches * (T + recompute + S)
        rollout = groups + micro_batches * (recompute + S)
    expected = {"forward": forward, "rollout": rollout, "step": 1}
    for out in ranks:
        for mode, count in expected.items():
            _, gathers = out[name, mode]
            assert gathers == count * out["units"], (mode, gathers, count, out["units"])
