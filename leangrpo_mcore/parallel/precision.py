"""Precision settings: dtype names, FSDP2's MixedPrecisionPolicy, and the forward-precision context.

The schedules open ``forward_precision(grad)`` around every policy forward: ``grad=True`` for a forward
whose graph is trained (Retain/Reweight selected steps, Native recomputes), ``False`` for rollout-only
forwards. The default is a no-op; with an FP8 recipe the TE backend's :class:`FP8Contexts` keeps
separate scaling state for the two kinds (``leangrpo_mcore.models.common.fp8``). Either way the SDE and
log-prob math after the forward runs in float32.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ForwardPrecision = Callable[[bool], ContextManager]


def torch_dtype(name: str) -> torch.dtype:
    """``float32`` / ``bfloat16`` / ``float16`` → the torch dtype; ValueError naming the valid names."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def mixed_precision_policy(param_dtype: str, reduce_dtype: str):
    """FSDP2 ``MixedPrecisionPolicy`` casting parameters to ``param_dtype`` and reducing in ``reduce_dtype``.

    Outputs are not cast (``output_dtype=None``): the velocity functions cast to float32 themselves.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))


def null_precision(grad: bool) -> ContextManager:
    """The default forward precision: nothing to enter."""
    return contextlib.nullcontext()


def fp8_precision(model: torch.nn.Module, config=None) -> ForwardPrecision:
    """Forward precision with TE FP8 contexts: training scales for trained forwards, rollout scales otherwise."""
    from leangrpo_mcore.models.common.fp8 import FP8Contexts

    contexts = FP8Contexts(model, config)

    def enter(grad: bool) -> ContextManager:
        return contexts.training() if grad else contexts.rollout()

    return enter
