"""FP8 forward contexts for the TE backend, with separate scaling state for rollout and training.

``model.fp8`` in the run config names a recipe; :func:`fp8_config` turns it into megatron-core's
TransformerConfig fields (``fp8`` format + ``fp8_recipe``) and :class:`FP8Contexts` opens megatron's
FP8 context (``megatron.core.fp8_utils.get_fp8_context``: TE ``fp8_autocast`` with the recipe and the
amax-reduction group) around a forward.

Delayed scaling keeps an amax history per TE module. No-grad rollout forwards see other activation
statistics than the training forwards (and far more of them), so letting them write into the same
history would skew the training scales. :class:`FP8Contexts` therefore keeps one copy of the forward
scaling state (``fp8_meta["scaling_fwd"]``: ``scale`` and ``amax_history``) per phase and swaps it
into the modules, in place, when a phase is entered. The backward state is only touched by training
backwards and is never swapped. Recipes without history (tensorwise / blockwise / mxfp8 current
scaling) need no swap. Only meaningful where TE is installed (GPU); tested in ``tests/gpu``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
_PHASES = ("rollout", "training")
_SWAPPED_META = "scaling_fwd"
_SWAPPED_FIELDS = ("scale", "amax_history")


def fp8_config(config: Any, recipe: Optional[str], *, fp8_format: str = "hybrid") -> Any:
    """A copy of ``config`` with megatron's FP8 fields set for ``recipe`` (None turns FP8 off)."""
    if recipe is None:
        return dataclasses.replace(config, fp8=None)
    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {', '.join(FP8_RECIPES)}")
    if fp8_format not in ("e4m3", "hybrid"):
        raise ValueError(f"FP8 format must be 'e4m3' or 'hybrid', got {fp8_format!r}")
    return dataclasses.replace(config, fp8=fp8_format, fp8_recipe=recipe)


def _fp8_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "fp8_meta", None), dict)]


def _capture(modules: list[torch.nn.Module]) -> list[Optional[dict]]:
    states = []
    for module in modules:
        meta = module.fp8_meta.get(_SWAPPED_META)
        states.append(None if meta is None else
                      {f: getattr(meta, f).detach().clone() for f in _SWAPPED_FIELDS if hasattr(meta, f)})
    return states


@torch.no_grad()
def _restore(modules: list[torch.nn.Module], states: list[Optional[dict]]) -> None:
    for module, state in zip(modules, states):
        meta = module.fp8_meta.get(_SWAPPED_META)
        if meta is None or state is None:
            continue
        for field_name, value in state.items():
            # In place: TE's global amax buffers hold references to these tensors.
            getattr(meta, field_name).copy_(value)


@torch.no_grad()
def _reset(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        meta = module.fp8_meta.get(_SWAPPED_META)
        if meta is not None:
            # TE's delayed-scaling initial state: empty amax history, unit scales.
            meta.amax_history.zero_()
            meta.scale.fill_(1.0)


class FP8Contexts:
    """Per-phase FP8 autocast for one model: ``with contexts.rollout(): ...`` / ``contexts.training()``."""

    def __init__(self, model: torch.nn.Module, config: Optional[Any] = None) -> None:
        self.model = model
        self.config = config if config is not None else model.config
        self._states: dict[str, Optional[list]] = {phase: None for phase in _PHASES}
        self._active: Optional[str] = None

    @property
    def enabled(self) -> bool:
        """Whether the config asks for FP8."""
        return bool(getattr(self.config, "fp8", None))

    def _swaps_history(self) -> bool:
        return getattr(self.config, "fp8_recipe", "delayed") == "delayed"

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
                with self._fp8_phase(name):
                    yield
        finally:
            self._active = None

    @contextlib.contextmanager
    def _fp8_phase(self, name: str) -> Iterator[None]:
        from megatron.core.fp8_utils import get_fp8_context

        swap = self._swaps_history()
        modules = _fp8_modules(self.model) if swap else []
        outer = _capture(modules)
        if swap:
            if self._states[name] is None:
                _reset(modules)  # a phase's first entry starts from TE's initial state, not another phase's
            else:
                _restore(modules, self._states[name])
        try:
            with get_fp8_context(self.config):
                yield
        finally:
            # After fp8_autocast's exit, which folds this phase's amaxes into its scales.
            if swap:
                modules = _fp8_modules(self.model)
                self._states[name] = _capture(modules)
                _restore(modules, outer)

    def rollout(self):
        """Context for no-grad rollout forwards."""
        return self.phase("rollout")

    def training(self):
        """Context for forwards whose graph is backpropagated."""
        return self.phase("training")
