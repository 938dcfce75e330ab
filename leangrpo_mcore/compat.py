"""The two software stacks the package runs on, and what differs between their releases, in one place.

Tested stacks (README, "Supported versions"): Python 3.11 + torch 2.13 + megatron-core 0.16.1 (the CPU
Quickstart) and Python 3.12 + torch 2.14 + megatron-core 0.19 (NVIDIA's current containers); megatron-core
0.17 and 0.18 in between. Where a release moved a name the package relies on, the difference is answered by
one function here, each with its own test (``tests/unit/test_compat.py``), instead of ``try/except`` at the
call sites. The megatron-core internals that stayed put are listed, with their checks, in
:mod:`leangrpo_mcore.parallel.mcore_internals`.

The dependencies' own noise is filtered here too: warnings and log lines about their internals or defaults
that no user of this package can act on (:data:`NOISE`). Each filter is narrowed to one message of one module,
and its test checks that the installed release still says it (a filter that matches nothing is removed).

Imports neither torch nor megatron-core at module level: the package's ``__init__`` installs the filters and
``leangrpo_mcore.config`` must stay free of torch.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Optional


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version`` ("2.14.1+cu130" -> (2, 14, 1), "0.19.0rc1" -> (0, 19, 0))."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)


def installed(distribution: str) -> Optional[tuple[int, ...]]:
    """The installed release of ``distribution`` (e.g. "megatron-core") as a tuple, or None when absent."""
    try:
        return version_tuple(metadata.version(distribution))
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------- megatron-core
MULTIMODULE_PIPELINES = (0, 17)
"""megatron-core 0.17 added multi-module pipelines: the schedules read the members of a
``MultiModuleProcessGroupCollection`` on the branch it takes (ours, a plain ``ProcessGroupCollection``, never)."""


def multimodule_group_members() -> frozenset[str]:
    """The public members of megatron's ``MultiModuleProcessGroupCollection`` (0.17+), empty before it existed."""
    from megatron.core import process_groups_config

    cls = getattr(process_groups_config, "MultiModuleProcessGroupCollection", None)
    if cls is None:
        return frozenset()
    fields = getattr(cls, "__dataclass_fields__", {})
    return frozenset(n for n in (*dir(cls), *fields) if not n.startswith("_"))


# ---------------------------------------------------------------------------------------------------- dependency noise
@dataclass(frozen=True)
class Noise:
    """One message a dependency prints that concerns none of this package's users, and the filter that hides it."""

    category: Optional[type]
    """The warning class (a ``warnings`` filter), or None for a ``logging`` record."""
    message: str
    """Regular expression matched at the start of the message (the format string, for a log record)."""
    module: str
    """The module the warning is attributed to (regular expression matched whole), or the logger's name."""
    source: str
    """The installed module whose source says it (the test reads it there)."""
    printed_by: str
    """Which stack prints it, and when."""
    why: str
    """Why it is harmless here."""


NOISE: tuple[Noise, ...] = (
    Noise(UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\.core\..*",
          "megatron.core.optimizer",
          "every stack at `import megatron.core` without TE / apex",
          "megatron falls back to torch; the package never uses megatron's optimizers or fused kernels"),
    Noise(UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\.models\.backends",
          "megatron.core.models.backends",
          "every stack, at the first pipeline-scheduler call (it imports megatron's multi-token prediction)",
          "the package's norms are its own (models/common)"),
    Noise(UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config",
          "megatron.core.transformer.transformer_config",
          "every stack, for every TransformerConfig",
          "megatron warns about its own default CUDA-graph scope ('full'), which the package never sets or uses"),
    Noise(DeprecationWarning, r"The following imports from `dynamic_context\.py` will be removed",
          r"megatron\.core\.inference\.contexts", "megatron.core.inference.contexts",
          "every stack at `import megatron.core`",
          "an import inside megatron's own package (megatron.core.inference_params); the package uses no inference "
          "context"),
    Noise(DeprecationWarning, r"`torch\.jit\.script_method` is deprecated", r"torch\.jit\._script",
          "torch.jit._script",
          "torch 2.13 when megatron-core's fused kernels import torch's inductor (torch.utils.mkldnn)",
          "torch's own modules use it; the package scripts nothing"),
    Noise(None, r"No CUDA runtime is found, using CUDA_HOME", "torch.utils.cpp_extension",
          "torch.utils.cpp_extension",
          "a CUDA build of torch on a machine without a GPU (the current stack on CPU CI): megatron-core 0.17+ "
          "imports torch's extension builder",
          "nothing is compiled; on a GPU machine the CUDA runtime is found and nothing is printed"),
)
"""Every message filtered (module doc)."""


class _DropMessages(logging.Filter):
    """Drops the records of one logger whose format string matches one of ``patterns``."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = tuple(re.compile(p) for p in patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p.match(str(record.msg)) for p in self.patterns)


def quiet_dependency_noise() -> None:
    """Install the filters of :data:`NOISE` (idempotent: a filter installed twice is kept once)."""
    loggers: dict[str, list[str]] = {}
    for noise in NOISE:
        if noise.category is None:
            loggers.setdefault(noise.module, []).append(noise.message)
        else:
            warnings.filterwarnings("ignore", message=noise.message, category=noise.category,
                                    module=noise.module + r"\Z")
    for name, patterns in loggers.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(tuple(patterns)))
