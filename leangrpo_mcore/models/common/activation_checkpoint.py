"""Per-block activation checkpointing (torch.utils.checkpoint, non-reentrant)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


def maybe_checkpoint(fn: Callable[..., Any], *args: Any, enabled: bool) -> Any:
    """``fn(*args)``, recomputed in backward instead of storing activations when ``enabled``.

    Only active while autograd records (no-grad rollout forwards run plainly). Non-reentrant
    checkpointing supports keyword-free calls with tensors and non-tensors mixed, nested autograd and
    the TP collectives inside a block (every rank recomputes the same block).
    """
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
