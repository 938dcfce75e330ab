"""Tensor-parallel helpers shared by every model family.

The tensor-parallel (TP) group comes from ``megatron.core.parallel_state``. When that module is not
initialised (a plain single process, no ``torch.distributed``), everything behaves as TP=1:
``tp_world_size() == 1``, ``tp_rank() == 0``, ``tp_group() is None`` and the collectives are identities.

Partitioned parameters carry megatron's attributes ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride`` (always 1 here). A parameter whose partitioned dimension is the concatenation of
independently sharded pieces (FLUX's single-block ``proj_out`` consumes ``cat(attention, mlp)``, both
column-sharded) also carries ``partition_segments``: the FULL sizes of those pieces. Its local shard is the
concatenation of each piece's rank slice, and :func:`shard_tensor` / :func:`gather_tensor` honour that.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def tp_is_initialized() -> bool:
    """True when megatron's model-parallel groups exist in this process."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    return _parallel_state().model_parallel_is_initialized()


def tp_group() -> Optional[dist.ProcessGroup]:
    """The tensor-parallel process group, or None when megatron parallel_state is not initialised."""
    if not tp_is_initialized():
        return None
    return _parallel_state().get_tensor_model_parallel_group()


def tp_world_size() -> int:
    """Number of ranks in the tensor-parallel group (1 without parallel_state)."""
    group = tp_group()
    return 1 if group is None else dist.get_world_size(group)


def tp_rank() -> int:
    """This process's rank inside the tensor-parallel group (0 without parallel_state)."""
    group = tp_group()
    return 0 if group is None else dist.get_rank(group)


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; ValueError when ``denominator`` does not divide ``numerator``."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator} (tensor-parallel split)")
    return numerator // denominator


def mark_tp_partitioned(param: torch.Tensor, dim: int, segments: Optional[Sequence[int]] = None) -> None:
    """Mark ``param`` as sharded over TP along ``dim`` (megatron attributes; stride 1).

    ``segments`` lists the FULL sizes of independently sharded pieces that make up dimension ``dim``
    (their sum is the full size); omit it for a plain contiguous split.
    """
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    if segments is not None:
        param.partition_segments = tuple(int(s) for s in segments)


def is_tp_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` carries megatron's ``tensor_model_parallel=True`` attribute."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _segments(param: torch.Tensor, full_size: int) -> tuple[int, ...]:
    return tuple(getattr(param, "partition_segments", None) or (full_size,))


def full_shape(param: torch.Tensor, world_size: Optional[int] = None) -> torch.Size:
    """The unsharded shape of a (possibly TP-partitioned) local parameter."""
    if not is_tp_partitioned(param):
        return param.shape
    world = tp_world_size() if world_size is None else world_size
    shape = list(param.shape)
    shape[param.partition_dim] *= world
    return torch.Size(shape)


def shard_tensor(full: torch.Tensor, like: torch.Tensor, rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> torch.Tensor:
    """This rank's slice of the FULL tensor ``full`` for the parameter ``like`` (its TP attributes)."""
    if not is_tp_partitioned(like):
        return full
    rank = tp_rank() if rank is None else rank
    world = tp_world_size() if world_size is None else world_size
    dim = like.partition_dim
    pieces = []
    for segment in torch.split(full, list(_segments(like, full.shape[dim])), dim=dim):
        pieces.append(segment.narrow(dim, rank * divide(segment.shape[dim], world), segment.shape[dim] // world))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def shard_ranges(like: torch.Tensor, full_size: int, rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> list[tuple[int, int]]:
    """(start, stop) ranges of the full partition dimension that make up this rank's shard, in order."""
    rank = tp_rank() if rank is None else rank
    world = tp_world_size() if world_size is None else world_size
    if not is_tp_partitioned(like):
        return [(0, full_size)]
    ranges, offset = [], 0
    for size in _segments(like, full_size):
        local = divide(size, world)
        ranges.append((offset + rank * local, offset + (rank + 1) * local))
        offset += size
    if offset != full_size:
        raise ValueError(f"partition segments sum to {offset}, but the full dimension is {full_size}")
    return ranges


def gather_tensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The FULL tensor of a TP-partitioned parameter, all-gathered over the TP group (no autograd)."""
    world = tp_world_size()
    if not is_tp_partitioned(like) or world == 1:
        return local.detach()
    dim = like.partition_dim
    chunks = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(chunks, local.detach().contiguous(), group=tp_group())
    full_size = local.shape[dim] * world
    local_sizes = [divide(s, world) for s in _segments(like, full_size)]
    per_rank = [torch.split(chunk, local_sizes, dim=dim) for chunk in chunks]
    # Piece i of the full tensor is the concatenation over ranks of each rank's i-th local piece.
    return torch.cat([torch.cat([parts[i] for parts in per_rank], dim=dim) for i in range(len(local_sizes))],
                     dim=dim)


class _AllReduce(torch.autograd.Function):
    """Sum over TP in forward; in backward either pass through or sum again (see all_reduce_tp)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, backward_all_reduce: bool) -> torch.Tensor:
        ctx.group = group
        ctx.backward_all_reduce = backward_all_reduce
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.backward_all_reduce:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _CopyToTP(torch.autograd.Function):
    """Identity in forward, sum over TP in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_tp(x: torch.Tensor, *, backward_all_reduce: bool = False) -> torch.Tensor:
    """Sum ``x`` over the TP group, autograd-correct; identity at TP=1.

    With the default ``backward_all_reduce=False`` the result must be consumed *replicated* (every rank
    does the same computation with it, megatron's reduce-from-TP-region): its gradient is already the
    full gradient on every rank. Set ``backward_all_reduce=True`` when the result feeds *sharded*
    computations (e.g. a norm statistic over the full width applied to local shards): each rank then
    holds only its shard's contribution, and the gradient must be summed as well.
    """
    group = tp_group()
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduce.apply(x, group, backward_all_reduce)


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """Identity in forward, all-reduce of the gradient over TP in backward; identity at TP=1.

    Use on a replicated tensor (or parameter) right before it enters sharded computations, so its
    gradient becomes the sum of every shard's contribution (megatron's copy-to-TP-region).
    """
    group = tp_group()
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)
