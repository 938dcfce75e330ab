"""Optimizer, learning-rate schedule and gradient clipping over sharded / tensor-parallel gradients.

- AdamW: NVIDIA apex's ``FusedAdam`` (AdamW mode) when it imports and every trainable parameter is a plain
  CUDA tensor; otherwise ``torch.optim.AdamW`` (which also handles FSDP2's DTensor parameters). SGD too.
- :func:`clip_grad_norm_` computes the global L2 norm once over the whole model: FSDP2 shards are summed
  over the sharding group, tensor-parallel partitions over the TP group, and weights replicated over TP
  are counted once. Accumulation is float64 so the norm does not depend on the order of the shards.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.models.backends import weights_changed
from leangrpo_mcore.parallel.mesh import ParallelContext


def _fused_adam():
    try:
        from apex.optimizers import FusedAdam
    except Exception:  # noqa: BLE001 - apex absent or broken: fall back to torch
        return None
    return FusedAdam


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters with ``requires_grad`` (LoRA adapters only, after ``mark_only_lora_trainable``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the policy has no trainable parameters")
    return params


def build_optimizer(params: Iterable[torch.nn.Parameter], optim) -> torch.optim.Optimizer:
    """The optimizer of an :class:`~leangrpo_mcore.config.schema.OptimConfig` over ``params``."""
    params = list(params)
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    if optim.name != "adamw":
        raise ValueError(f"unknown optimizer {optim.name!r}; valid: adamw, sgd")
    if len(optim.betas) != 2:
        raise ValueError(f"optim.betas must be two numbers, got {optim.betas}")
    betas = (float(optim.betas[0]), float(optim.betas[1]))
    fused = _fused_adam()
    plain_cuda = all(p.is_cuda and type(p.data) is torch.Tensor for p in params)
    if fused is not None and plain_cuda:
        return fused(params, lr=optim.lr, betas=betas, eps=optim.eps, weight_decay=optim.weight_decay,
                     adam_w_mode=True)
    return torch.optim.AdamW(params, lr=optim.lr, betas=betas, eps=optim.eps, weight_decay=optim.weight_decay)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim, total_steps: int):
    """Linear warm-up for ``optim.warmup_steps``, then constant / linear / cosine decay to 0 at ``total_steps``."""
    warmup, kind = int(optim.warmup_steps), optim.lr_scheduler
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr_scheduler {kind!r}; valid: constant, linear, cosine")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def grad_norm(params: Iterable[torch.nn.Parameter], ctx: ParallelContext) -> float:
    """Global L2 norm of the gradients of ``params`` (each element counted once over all ranks)."""
    params = [p for p in params if p.grad is not None]
    sharded = replicated = torch.zeros((), dtype=torch.float64)
    for p in params:
        sq = _local(p.grad).detach().double().square().sum().cpu()
        if getattr(p, "tensor_model_parallel", False):
            sharded = sharded + sq
        else:
            replicated = replicated + sq
    # Weights replicated over TP have equal gradients on every TP rank: count them on TP rank 0 only.
    total = sharded + (replicated if ctx.tp_rank == 0 else torch.zeros_like(replicated))
    if dist.is_available() and dist.is_initialized():
        device = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
        total = total.to(device)
        shard_group = ctx.dp_shard_group()
        if shard_group is not None and ctx.fsdp_shard_size > 1:
            dist.all_reduce(total, group=shard_group)
        if ctx.tp_group is not None and ctx.layout.tp > 1:
            dist.all_reduce(total, group=ctx.tp_group)
        if ctx.pp_group is not None:  # every stage holds its own blocks' gradients
            dist.all_reduce(total, group=ctx.pp_group)
    return math.sqrt(float(total))


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, ctx: ParallelContext) -> tuple[float, bool]:
    """Scale the gradients so their global norm is at most ``max_norm`` (0 disables); returns (norm, clipped)."""
    params = list(params)
    norm = grad_norm(params, ctx)
    if max_norm <= 0 or not math.isfinite(norm):
        return norm, False
    coef = max_norm / (norm + 1e-6)
    if coef >= 1.0:
        return norm, False
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef)
    return norm, True


def zero_grad(params: Iterable[torch.nn.Parameter]) -> None:
    """Drop every gradient (``None``, so the next backward starts from nothing)."""
    for p in params:
        p.grad = None


def optimizer_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                   scheduler: Optional[object] = None) -> None:
    """One optimizer (and scheduler) step, then clear the gradients."""
    optimizer.step()
    weights_changed()
    if scheduler is not None:
        scheduler.step()
    zero_grad(params)
