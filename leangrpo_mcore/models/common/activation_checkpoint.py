"""Per-block activation checkpointing (torch.utils.checkpoint, non-reentrant; TE's under FP8)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


def maybe_checkpoint(fn: Callable[..., Any], *args: Any, enabled: bool, fp8: bool = False) -> Any:
    """``fn(*args)``, recomputed in backward instead of storing activations when ``enabled``.

    Only active while autograd records (no-grad rollout forwards run plainly). Non-reentrant
    checkpointing supports keyword-free calls with tensors and non-tensors mixed, nested autograd and
    the TP collectives inside a block (every rank recomputes the same block).

    Under FP8 (``fp8``) the recompute runs in backward, after the forward's FP8 autocast has exited: torch's
    checkpoint would recompute unquantised, a different forward than the one whose graph it replaces. TE's
    checkpoint restores the FP8 autocast state for the recompute.
    """
    if enabled and torch.is_grad_enabled():
        if fp8:
            from transformer_engine.pytorch.distributed import checkpoint as te_checkpoint

            return te_checkpoint(fn, *args, use_reentrant=False)
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
