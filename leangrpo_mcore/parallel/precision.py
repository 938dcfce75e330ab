"""Precision settings: the dtypes of a run, FSDP2's MixedPrecisionPolicy, and the forward-precision context.

A run has four dtypes (:func:`run_precision`): the master weights and optimizer state (``model.master_dtype``,
float32 by default: at learning rates near 1e-5 most bf16 updates would round away), the compute dtype of the
forwards and backwards (``model.dtype``; FSDP2 casts the master weights to it), the gradient reduction
(``parallel.reduce_dtype``) and Reweight's provisional gradients (``schedule.provisional_dtype``).

The schedules open ``forward_precision(grad)`` around every policy forward: ``grad=True`` for a forward
whose graph is trained (Retain/Reweight selected steps, Native recomputes), ``False`` for rollout-only
forwards. The default is a no-op; with an FP8 recipe the TE backend's :class:`FP8Contexts` keeps
separate scaling state for the two kinds (``leangrpo_mcore.models.common.fp8``). Either way the SDE and
log-prob math after the forward runs in float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

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


@dataclass(frozen=True)
class RunPrecision:
    """The dtypes of a run, resolved from its config (names as in the config)."""

    compute: str
    """Forwards and backwards (``model.dtype``): FSDP2 casts the master weights to it."""
    master: str
    """Master weights (FSDP2 shards) and optimizer state (``model.master_dtype``)."""
    reduce: str
    """Gradient reduction (``parallel.reduce_dtype``)."""
    provisional: str
    """Reweight's provisional gradients (``schedule.provisional_dtype``)."""
    legacy_note: Optional[str] = None
    """What a config that predates ``model.master_dtype`` now means (logged once), or None."""

    @property
    def casts(self) -> bool:
        """Whether forwards run in another dtype than the master weights (needs FSDP2's cast)."""
        return self.compute != self.master


def run_precision(model: Any, parallel: Any, schedule: Any) -> RunPrecision:
    """Resolve the dtypes of the ``model``, ``parallel`` and ``schedule`` config sections; ValueError (one line)
    when they contradict each other."""
    master = model.master_dtype or "float32"
    if parallel.param_dtype is not None and parallel.param_dtype != model.dtype:
        raise ValueError(f"parallel.param_dtype={parallel.param_dtype} differs from model.dtype={model.dtype}: "
                         f"model.dtype is the compute dtype FSDP2 casts to; set it (and model.master_dtype for the "
                         f"master weights) instead")
    if DTYPES[model.dtype].itemsize > DTYPES[master].itemsize:
        raise ValueError(f"model.dtype={model.dtype} (compute) is wider than model.master_dtype={master}")
    note = None
    if model.master_dtype is None and model.dtype != "float32":
        note = (f"model.dtype={model.dtype} is the compute dtype; the master weights and the optimizer state are "
                f"float32 (model.master_dtype: null)")
    return RunPrecision(compute=model.dtype, master=master, reduce=parallel.reduce_dtype,
                        provisional=schedule.provisional_dtype or parallel.reduce_dtype, legacy_note=note)
