"""FP8 forward contexts for the TE backend: current-scaling recipes only.

``model.fp8`` in the run config names a recipe; :func:`fp8_config` turns it into megatron-core's
TransformerConfig fields (``fp8`` format + ``fp8_recipe``) and :class:`FP8Contexts` opens megatron's
FP8 context (``megatron.core.fp8_utils.get_fp8_context``: TE ``fp8_autocast`` with the recipe and the
amax-reduction group) around a forward.

Why current scaling only: TE's delayed scaling updates its scales from the amax history when an autocast region
exits *with grad enabled*. The rollout runs under ``no_grad``, so after each reset it would quantise with stale
or unit scales, and Native's rollout-vs-recompute log-prob ratios would leave the clip range (1e-4) almost
everywhere. Current scaling (``tensorwise``, ``blockwise``, ``mxfp8``) derives each tensor's scale from that
tensor when it is quantised: no history, so rollout and training forwards need no separate state.

Amax reductions run over the tensor-parallel group only (``tp_only_amax_red``): the ranks of a TP group always run
the same forward, while data-parallel ranks may not (DanceGRPO selection under Reweight trains different steps on
different ranks), and a reduction over them would pair unrelated collectives. Only meaningful where TE is
installed (GPU); tested in ``tests/gpu``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

TE_RECIPES = {"tensorwise": ("Float8CurrentScaling", (2, 2)), "blockwise": ("Float8BlockScaling", (2, 3)),
              "mxfp8": ("MXFP8BlockScaling", (2, 1))}
"""Per recipe name (megatron's ``fp8_recipe``): the Transformer Engine recipe class megatron-core builds for it and
the first TE release that has it. Every one exists in the TE range ``setup.py``'s ``te`` extra declares."""
FP8_RECIPES = tuple(TE_RECIPES)
_PHASES = ("rollout", "training")


def fp8_alignment(recipe: Optional[str]) -> int:
    """The dimension multiple an FP8 GEMM of ``recipe`` needs (MXFP8 blocks are 32 wide, the others 16)."""
    return 32 if recipe == "mxfp8" else 16


def fp8_config(config: Any, recipe: Optional[str], *, fp8_format: str = "hybrid") -> Any:
    """A copy of ``config`` with megatron's FP8 fields set for ``recipe`` (None turns FP8 off)."""
    if recipe is None:
        return dataclasses.replace(config, fp8=None)
    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {', '.join(FP8_RECIPES)} (delayed "
                         f"scaling is not offered: it never calibrates during no-grad rollouts)")
    if fp8_format not in ("e4m3", "hybrid"):
        raise ValueError(f"FP8 format must be 'e4m3' or 'hybrid', got {fp8_format!r}")
    return dataclasses.replace(config, fp8=fp8_format, fp8_recipe=recipe, tp_only_amax_red=True)


class FP8Contexts:
    """Per-phase FP8 autocast for one model: ``with contexts.rollout(): ...`` / ``contexts.training()``."""

    def __init__(self, model: Any, config: Optional[Any] = None) -> None:
        self.model = model
        self.config = config if config is not None else model.config
        self._active: Optional[str] = None

    @property
    def enabled(self) -> bool:
        """Whether the config asks for FP8."""
        return bool(getattr(self.config, "fp8", None))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """FP8 autocast for the ``rollout`` or ``training`` phase (a no-op when FP8 is off)."""
        if name not in _PHASES:
            raise ValueError(f"unknown FP8 phase {name!r}; choose one of {', '.join(_PHASES)}")
        if self._active is not None:
            raise ValueError(f"FP8 phase {name!r} entered inside phase {self._active!r}")
        self._active = name
        try:
            if not self.enabled:
                yield
            else:
                from megatron.core.fp8_utils import get_fp8_context

                with get_fp8_context(self.config):
                    yield
        finally:
            self._active = None

    def rollout(self):
        """Context for no-grad rollout forwards."""
        return self.phase("rollout")

    def training(self):
        """Context for forwards whose graph is backpropagated."""
        return self.phase("training")
