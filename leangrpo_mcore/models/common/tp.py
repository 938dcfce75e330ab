"""Tensor-parallel helpers shared by every model family.

The tensor-parallel (TP) group comes from ``megatron.core.parallel_state``. When that module is not
initialised (a plain single process, no ``torch.distributed``), everything behaves as TP=1:
``tp_world_size() == 1``, ``tp_rank() == 0``, ``tp_group() is None`` and the collectives are identities.

Partitioned parameters carry megatron's attributes ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride`` (always 1 here): rank ``r`` of ``n`` holds the ``r``-th of ``n`` contiguous slices of the
FULL tensor along ``partition_dim``. Layers whose natural FULL layout would not split that way (fused q/k/v,
FLUX's single-block ``proj_out``) store their FULL tensors interleaved per head instead, so that it does (see
``docs/models.md``).
"""

from __future__ import annotations

from typing import Optional

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


def mark_tp_partitioned(param: torch.Tensor, dim: int) -> None:
    """Mark ``param`` as sharded over TP along ``dim`` in contiguous slices (megatron attributes; stride 1)."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def is_tp_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` carries megatron's ``tensor_model_parallel=True`` attribute."""
    return bool(getattr(param, "tensor_model_parallel", False))


_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")

TPLayout = dict[str, torch.Tensor]
"""``{parameter name: meta tensor carrying its TP attributes}`` (:func:`capture_tp_layout`)."""


def capture_tp_layout(model: torch.nn.Module) -> TPLayout:
    """``{parameter name: meta tensor carrying its TP attributes}``; call before FSDP wraps the model (FSDP2
    drops megatron's attributes, which checkpoints and the loaders still need)."""
    layout: TPLayout = {}
    for name, tensor in model.named_parameters():
        stub = torch.empty(0, device="meta")
        for attr in _TP_ATTRS:
            if hasattr(tensor, attr):
                setattr(stub, attr, getattr(tensor, attr))
        layout[name] = stub
    return layout


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
    size = divide(full.shape[dim], world)
    return full.narrow(dim, rank * size, size)


def shard_range(like: torch.Tensor, full_size: int, rank: Optional[int] = None,
                world_size: Optional[int] = None) -> tuple[int, int]:
    """(start, stop) of this rank's slice of the full partition dimension of ``like``."""
    if not is_tp_partitioned(like):
        return 0, full_size
    rank = tp_rank() if rank is None else rank
    world = tp_world_size() if world_size is None else world_size
    size = divide(full_size, world)
    return rank * size, (rank + 1) * size


def gather_tensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The FULL tensor of a TP-partitioned parameter, all-gathered over the TP group (no autograd)."""
    world = tp_world_size()
    if not is_tp_partitioned(like) or world == 1:
        return local.detach()
    chunks = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(chunks, local.detach().contiguous(), group=tp_group())
    return torch.cat(chunks, dim=like.partition_dim)


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


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension in forward; this rank's slice of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, x.contiguous(), group=group)
        return torch.cat(chunks, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = grad.shape[-1] // dist.get_world_size(ctx.group)
        return grad.narrow(-1, dist.get_rank(ctx.group) * size, size).contiguous(), None


def gather_from_tp(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order); identity at TP=1.

    megatron's gather-from-TP-region (``ColumnParallelLinear(gather_output=True)``): the result must be
    consumed *replicated*, so its gradient is the same on every rank and each rank keeps its own slice.
    """
    group = tp_group()
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherLastDim.apply(x, group)
