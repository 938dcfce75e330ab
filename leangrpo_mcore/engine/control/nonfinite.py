"""Non-finite updates: skipped on every rank when any rank's gradient holds a NaN or inf, and the run stopped when
they repeat (``train.max_nonfinite_skips``) or when the first step after a resume has one."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from leangrpo_mcore.engine.launch import collective_device
from leangrpo_mcore.errors import UserError


class TrainingStopped(UserError):
    """The run stopped itself (repeated non-finite updates); reported as one line, exit code 2."""


class NonFiniteGuard:
    """An optimizer pre-step hook: if any rank holds a non-finite gradient, drop every gradient (skip the update)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.skipped = 0
        self._handle = optimizer.register_step_pre_hook(self._check)

    def _check(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flag = torch.zeros(1, device=collective_device())
        if local:
            # One flag for all gradients: a single host sync instead of one per tensor.
            finite = torch.stack([torch.isfinite(g).all() for g in local]).all()
            flag += (~finite).to(flag.device, torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self.skipped += 1


def check_streak(step: int, streak: int, *, resumed_step: Optional[int], max_skips: int) -> None:
    """TrainingStopped when ``step``, the first after resuming from ``resumed_step``, was skipped, or when
    ``streak`` consecutive updates up to it were (``max_skips``: ``train.max_nonfinite_skips``, at least 1)."""
    if resumed_step is not None and step == resumed_step + 1 and streak:
        raise TrainingStopped(f"step {step}, the first after resuming from step {resumed_step}, has a "
                              f"non-finite loss or gradient; the checkpoint does not train")
    if streak >= max(max_skips, 1):
        raise TrainingStopped(f"stopping at step {step}: {streak} consecutive updates had a "
                              f"non-finite loss or gradient (train.max_nonfinite_skips="
                              f"{max_skips}); lower optim.lr or check the reward")
