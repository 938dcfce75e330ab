"""megatron-core, imported without the two things its import pulls in that this project does not use there.

Any ``import megatron.core.<module>`` first runs megatron-core's package ``__init__``, which imports
``tensor_parallel`` and ``inference_params`` and through them, in every process:

- torch's compiler stack (``torch._dynamo`` and ``torch._inductor``): ``megatron.core.jit`` binds
  ``jit_fuser = torch.compile``, ``transformer_config`` imports the ``fusions`` modules, and they decorate a dozen
  functions with it. Building each ``torch.compile`` wrapper imports the compiler, although nothing is compiled
  before a call. Of those functions this project calls one, the fused bias-GeLU, and only on CUDA
  (:func:`~leangrpo_mcore.models.backends.activate`).
- ``wandb`` (when installed): ``megatron.core.inference.contexts.dynamic_context`` imports it for the statistics
  of megatron's dynamic inference engine, which this project never runs. A run with ``logging.wandb`` imports
  wandb itself when it opens the run (:mod:`~leangrpo_mcore.engine.output.wandb_log`).

Together they cost about two seconds of every process's start. :func:`import_megatron_core` imports megatron-core
once with ``torch.compile`` replaced by :func:`deferred_compile` (the same compile with the same options, built at
the first call instead of at decoration: the compiled code is the same, and the compiler is imported only where a
compiled function runs) and with wandb's import made to fail (``sys.modules["wandb"] = None``, Python's
documented way to block one import: megatron then records that wandb is absent, as on a machine without it).
Both are undone before it returns; a wandb that was already imported is left as it is. This is the one place
that changes how a library imports; megatron-core offers no switch for either (``megatron.core.jit``'s own
``disable_jit_fuser`` can only run after the package ``__init__`` has decorated everything), and
:mod:`~leangrpo_mcore.parallel.mcore_internals` checks that the two internals are still as assumed.

The modules that import megatron-core at their top (``models/backends.py``, which ``leangrpo_mcore.models``
imports first, and ``parallel/pipeline.py``) call :func:`import_megatron_core` before their megatron imports.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

_TORCH_COMPILE = torch.compile
BLOCKED = "wandb"
"""The module megatron-core's import is kept from importing."""


def deferred_compile(fn: Callable | None = None, **options: Any) -> Callable:
    """``torch.compile(fn, **options)`` built at the first call of the result (also as ``@deferred_compile(...)``)."""
    if fn is None:
        return functools.partial(deferred_compile, **options)
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(_TORCH_COMPILE(fn, **options))
        return compiled[0](*args, **kwargs)

    return call


def import_megatron_core() -> None:
    """Import ``megatron.core`` (once per process) without torch's compiler stack and wandb (module docstring)."""
    if "megatron.core" in sys.modules:
        return
    blocked = BLOCKED not in sys.modules
    torch.compile = deferred_compile
    if blocked:
        sys.modules[BLOCKED] = None  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = _TORCH_COMPILE
        if blocked:
            del sys.modules[BLOCKED]
