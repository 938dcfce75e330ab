"""Reweight at pp=2 on 2 gloo ranks with its gradient routing broken on purpose on one stage: every stage raises
RoutingError naming the micro-batch and its key (no parity mismatch to interpret, no stage left waiting).

- skip: stage 0 does not route micro-batch 1 of a call (its gradient would silently join micro-batch 0's
  provisional gradient under a bracket counted in order);
- reverse: stage 1 assigns the call's keys in reverse order (each sample's provisional gradient on stage 1 would
  be another sample's).

The same step unbroken runs through (its gradients are checked against world size 1 in
``test_pipeline_parallel.py``).
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_ranks
from tests.unit.test_schedules_parity import Case

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASE = Case(family="flux", schedule="reweight", pp=2, group_size=4, prompts=1, num_steps=3)


def _breaks(rank: int, world_size: int, case: Case) -> dict:
    """Run ``case`` unbroken, then with each break on its stage; the RoutingError message of each (None: none)."""
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context
    from leangrpo_mcore.parallel.routing import GradientRouter, RoutingError
    from tests.unit.test_schedules_parity import run_case

    real_route, real_init = GradientRouter.route, GradientRouter.__init__

    def skip_one(self, k, output):
        return output if k == 1 else real_route(self, k, output)

    def reversed_keys(self, sync, keys, open_slot, group=None):
        real_init(self, sync, list(reversed(keys)), open_slot, group)

    breaks = {"none": (None, None, None), "skip": (0, "route", skip_one), "reverse": (1, "__init__", reversed_keys)}
    out = {}
    for name, (stage, attr, broken) in breaks.items():
        if rank == stage:
            setattr(GradientRouter, attr, broken)
        try:
            run_case(case)
            out[name] = None
        except RoutingError as error:
            out[name] = str(error)
        finally:
            GradientRouter.route, GradientRouter.__init__ = real_route, real_init
    destroy_parallel_context()
    return out


def test_broken_routing_raises_on_every_stage():
    ranks = run_ranks(_breaks, 2, CASE, timeout=300)
    for rank in ranks:
        assert rank["none"] is None
        # the first call routes group 0's 4 samples (rollout micro-batches 0..3, row 0) at its first trained step
        assert "stage 0: 3 routed backwards for the call's 4 micro-batches" in rank["skip"], rank["skip"]
        assert "(1, ('pg', 0, 1, 0))" in rank["skip"], rank["skip"]
        assert "stage 0 routed micro-batch 0 to ('pg', 0, 0, 0), stage 1 micro-batch 0 to ('pg', 0, 3, 0)" \
            in rank["reverse"], rank["reverse"]
    assert ranks[0]["skip"] == ranks[1]["skip"] and ranks[0]["reverse"] == ranks[1]["reverse"]
