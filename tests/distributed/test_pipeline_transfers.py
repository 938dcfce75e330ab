"""The transfers of megatron's pipelined schedules at pp=2 on gloo ranks: a call allocates its receive buffers in
the one boundary shape its micro-batches share (no shape exchange before a transfer, no device synchronisation
after one), and ends with ONE velocity broadcast whatever its number of requests; the velocities equal the
lock-step forwards bit for bit, and a policy that cannot tell its boundary shape still works (shapes exchanged)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed


class _Counts:
    """Shape exchanges and device synchronisations inside megatron's pipelined schedules, and broadcasts by dtype."""

    def __init__(self) -> None:
        self.inside = False
        self.shapes = self.syncs = 0
        self.broadcasts: dict[str, int] = {}

    def install(self) -> None:
        """Wrap megatron's and torch's functions (this spawned process only)."""
        import megatron.core.pipeline_parallel as mcore_pp
        import torch.distributed as dist
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        from leangrpo_mcore.parallel import pipeline

        shapes, broadcast, get = P2PCommunicator._communicate_shapes, dist.broadcast, mcore_pp.get_forward_backward_func

        def counted_shapes(communicator, *args, **kwargs):
            self.shapes += self.inside
            return shapes(communicator, *args, **kwargs)

        def counted_sync(*args, **kwargs):
            self.syncs += self.inside

        def counted_broadcast(tensor, *args, **kwargs):
            key = str(tensor.dtype).replace("torch.", "")
            self.broadcasts[key] = self.broadcasts.get(key, 0) + 1
            return broadcast(tensor, *args, **kwargs)

        def spied(pp_size=None, vp_size=None):
            inner = get(pp_size=pp_size, vp_size=vp_size)

            def call(**kwargs):
                self.inside = True
                try:
                    return inner(**kwargs)
                finally:
                    self.inside = False
            return call

        P2PCommunicator._communicate_shapes = counted_shapes
        pipeline._CpuCuda.synchronize = staticmethod(counted_sync)
        dist.broadcast = counted_broadcast
        mcore_pp.get_forward_backward_func = spied

    def take(self) -> dict:
        """The counts so far, then zero."""
        out = {"shapes": self.shapes, "syncs": self.syncs, **self.broadcasts}
        self.shapes = self.syncs = 0
        self.broadcasts = {}
        return out


def _rank(rank: int, world_size: int, family: str) -> dict:
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context
    from leangrpo_mcore.parallel.stages import StagedVelocity, StageLink
    from tests.unit.test_schedules_parity import Case, _setup

    counts = _Counts()
    counts.install()
    ctx = build_parallel_context(Layout(pp=2))
    try:
        policy, velocity, shape, sigmas, _, _, cond = _setup(Case(family=family, pp=2, prompts=3), ctx.pp_rank)
        staged = StagedVelocity(velocity, StageLink(ctx, torch.float32))
        gen = torch.Generator().manual_seed(0)
        requests = [(torch.randn(1, *shape, generator=gen), sigmas[[i]], cond.select([i])) for i in range(3)]
        with torch.no_grad():
            lock_step = [staged(*request) for request in requests]
            counts.take()
            pipelined = staged.velocities(requests)
            one_shape = counts.take()
            staged.boundary_shape = lambda requests: None  # a policy without boundary_shape
            exchanged = staged.velocities(requests)
            fallback = counts.take()
    finally:
        destroy_parallel_context()
    same = all(torch.equal(a, b) for a, b in zip(lock_step, pipelined)) and \
        all(torch.equal(a, b) for a, b in zip(lock_step, exchanged))
    return {"one_shape": one_shape, "fallback": fallback, "same": same, "nonzero": float(lock_step[0].abs().max())}


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_one_boundary_shape_and_one_velocity_broadcast_per_pipelined_call(family):
    for result in run_ranks(_rank, 2, family, timeout=240):
        assert result["same"] and result["nonzero"] > 0, result
        # 3 requests: no shape exchange, no synchronisation; one float32 broadcast of the 3 velocities, one int32
        # broadcast of the pipeline guard (whether the last stage failed)
        assert result["one_shape"] == {"shapes": 0, "syncs": 0, "float32": 1, "int32": 1}, result
        # without a boundary shape: every transfer exchanges its shape first (3 forwards sent or received)
        assert result["fallback"]["shapes"] == 3 and result["fallback"]["float32"] == 1, result
