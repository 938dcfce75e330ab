"""Mesh construction, reward gathering and the flat coalesced reduce-scatter on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed


class _Toy(torch.nn.Module):
    """Blocks with dim-0 sizes that do not split evenly over 2 ranks (FSDP pads them)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, 3)
        self.body = torch.nn.ModuleList([torch.nn.Linear(3, 7), torch.nn.Linear(7, 5)])

    def blocks(self):
        return list(self.body)

    def forward(self, x):
        return self.body[1](torch.tanh(self.body[0](self.inp(x))))


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def _sync_checks(rank: int, ctx) -> dict:
    from leangrpo_mcore.parallel.fsdp import apply_fsdp
    from leangrpo_mcore.parallel.grad_sync import GradSync

    torch.manual_seed(0)
    model = apply_fsdp(_Toy(), ctx)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    native = GradSync(model, ctx, mode="per_backward")
    native.backward(model(x).square().sum())
    native.finish()
    fsdp_reduced = _grads(model)
    model.zero_grad(set_to_none=True)
    flat = GradSync(model, ctx, mode="coalesced")
    flat.backward(model(x).square().sum())
    local = flat.take_local()
    local_shapes = [tuple(g.shape) for g in local]
    flat.put_local(local)
    flat.finish()
    ours = _grads(model)
    model.zero_grad(set_to_none=True)
    scaled = GradSync(model, ctx, mode="coalesced")
    scaled.backward(model(x).square().sum())
    scaled.reduce_local([g * 2.0 for g in scaled.take_local()])
    scaled.finish()
    twice = _grads(model)
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(fsdp_reduced, ours)),
        "scaled": all(torch.equal(2.0 * a, b) for a, b in zip(ours, twice)),
        "local_shapes": local_shapes,
        "reductions": flat.num_reductions,
        "sum": [g.sum().item() for g in ours],
    }


def _mesh_and_gather(rank: int, world_size: int) -> dict:
    from leangrpo_mcore.parallel.groups import (PromptShare, build_group_process_groups, gather_group_rewards,
                                                gather_step_rewards)
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context

    out = {}
    ctx = build_parallel_context(Layout(tp=1))
    out["dp"] = (ctx.dp_rank, ctx.dp_size, ctx.tp_rank, dist.get_process_group_ranks(ctx.dp_group))
    out["sync"] = _sync_checks(rank, ctx)
    groups = build_group_process_groups("shared", 2, 4, ctx.dp_global_ranks)
    share = PromptShare(prompt_slot=0, generation_ids=(rank, rank + 2), group_ranks=(0, 1))
    local = torch.tensor([10.0 * rank, 10.0 * rank + 2.0])
    out["group"] = gather_group_rewards(local, share, 4, groups[(0, 1)]).tolist()
    table = gather_step_rewards({(0, rank): 1.0 + rank, (0, rank + 2): 3.0 + rank}, 1, 4, ctx.dp_group,
                                torch.device("cpu"))
    out["table"] = table.tolist()
    destroy_parallel_context()
    ctx = build_parallel_context(Layout(tp=1, dp_replicate=2))  # HSDP: replicate 2 x shard 1
    out["hsdp"] = (ctx.dp_rank, ctx.dp_size, ctx.dp_replicate_group() is not None, _sync_checks(rank, ctx))
    destroy_parallel_context()
    ctx = build_parallel_context(Layout(tp=2))
    out["tp"] = (ctx.dp_rank, ctx.dp_size, ctx.tp_rank, ctx.dp_mesh is None,
                 dist.get_process_group_ranks(ctx.tp_group))
    destroy_parallel_context()
    return out


def test_mesh_groups_and_flat_reduce_scatter():
    results = run_ranks(_mesh_and_gather, 2, timeout=300)
    for rank, out in enumerate(results):
        assert out["dp"] == (rank, 2, 0, [0, 1])
        assert out["tp"] == (0, 1, rank, True, [0, 1])
        assert out["sync"]["bitwise"], "flat reduce-scatter must equal FSDP2's own (2-rank sums commute)"
        assert out["sync"]["scaled"]
        assert out["sync"]["reductions"] == 1
        assert out["sync"]["local_shapes"] == [(3, 5), (3,), (7, 3), (7,), (5, 7), (5,)]
        assert out["group"] == [0.0, 10.0, 2.0, 12.0]
        assert out["hsdp"][:3] == (rank, 2, True)
        assert out["hsdp"][3]["bitwise"] and out["hsdp"][3]["scaled"]
        assert out["hsdp"][3]["sum"] == out["sync"]["sum"]  # replicate + all-reduce sums like sharding does
        assert out["table"] == [[1.0, 2.0, 3.0, 4.0]]
    assert results[0]["sync"]["sum"] == results[1]["sync"]["sum"]
