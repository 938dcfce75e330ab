"""DanceGRPO at parallel.pp=2 x dp_shard=2 (4 gloo ranks) equals world size 1, with unequal work per rank.

DanceGRPO draws the trained steps per sample, so at a denoising step the two data-parallel ranks of a stage train
different numbers of samples: Reweight's 1F1B call of that step (one micro-batch per trained sample) has a
different number of micro-batches on each. FSDP2 shards each stage over its data-parallel pair while the pair runs
schedules of different lengths (safe because Reweight keeps the parameters gathered through the step); each
stage's gradients must still be its parameters' gradients of the world-size-1 step (1e-5 relative), with the same
rewards and global gradient norm.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.launcher import run_ranks
from tests.distributed.test_pipeline_parallel import _reference, _run_all, _stage_grads
from tests.unit.test_schedules_parity import Case, rel_l2
from tests.once import once_per_process

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DANCE = Case(family="flux", pp=2, selection="dance_grpo", fraction=0.6, advantage="dance_grpo",
             sde_kind="dance_grpo", num_steps=5)
CASES = {"reweight": DANCE.but(schedule="reweight")}


@pytest.fixture(scope="module")
@once_per_process
def unequal_ranks():
    return run_ranks(_run_all, 4, CASES, timeout=500), _reference(CASES)


def _backward_calls(rank: dict, name: str) -> list[int]:
    """The micro-batch counts of this rank's pipelined calls with backwards (megatron's 1F1B), in order."""
    return [count for pp_size, count, forward_only in rank["pp_sizes"][name] if not forward_only and pp_size == 2]


def test_dance_grpo_pp2_dp2_unequal_micro_batches_equal_world_size_1(unequal_ranks):
    ranks, reference = unequal_ranks
    for name, ref in reference.items():
        # ranks 0 and 1 are the first stage's data-parallel pair (2 and 3 the second stage's)
        first, second = _backward_calls(ranks[0], name), _backward_calls(ranks[1], name)
        assert first and first != second, (name, first, second)  # the pair runs different amounts of work
        assert _backward_calls(ranks[2], name) == first and _backward_calls(ranks[3], name) == second, name
        assert sorted(ranks[0][name].names + ranks[2][name].names) == sorted(ref.names), name
        for out in (rank[name] for rank in ranks):
            expected, mine = _stage_grads(ref, out)
            assert max(float(np.abs(g).max()) for g in mine) > 0, name
            assert rel_l2(expected, mine) <= 1e-5, name
            assert np.array_equal(out.rewards, ref.rewards), name
            assert out.grad_norms[0] == pytest.approx(ref.grad_norms[0], rel=1e-5), name
        assert not np.array_equal(ranks[0][name].trajectory, ranks[1][name].trajectory), name
