"""Random initialisation that is identical at every tensor-parallel size.

Every parameter carries an init rule (``set_init``): a function of the FULL (unsharded) shape and a
``torch.Generator`` that returns the full tensor. :func:`init_parameters` seeds one CPU generator per
parameter from ``(seed, parameter name)``, builds the full tensor and copies this rank's TP slice into
the parameter. The result depends on the seed and the names only: TP=2 holds exactly the slices of the
TP=1 model, and the construction order of modules does not matter.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

from leangrpo_mcore.models.common.tp import full_shape, shard_tensor

InitFn = Callable[[torch.Size, torch.Generator], torch.Tensor]
_INIT_ATTR = "leangrpo_init"


def set_init(param: torch.Tensor, fn: InitFn) -> None:
    """Attach the init rule ``fn(full_shape, generator) -> full tensor`` to ``param``."""
    setattr(param, _INIT_ATTR, fn)


def uniform_fan_in(fan_in: int) -> InitFn:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch's default for nn.Linear weights and biases."""
    bound = 1.0 / math.sqrt(max(fan_in, 1))

    def init(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)

    return init


def normal_init(std: float) -> InitFn:
    """N(0, std^2)."""

    def init(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    return init


def constant_init(value: float) -> InitFn:
    """Every element equal to ``value`` (ones for norm scales, zeros for LoRA B)."""

    def init(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        return torch.full(shape, float(value), dtype=torch.float32)

    return init


def _param_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2**63 - 1)


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, seed: int) -> None:
    """Initialise one parameter, known in the model as ``name``, from its init rule (TP-invariant)."""
    fn = getattr(param, _INIT_ATTR, None)
    if fn is None:
        raise ValueError(f"parameter {name} has no init rule (use common.init.set_init)")
    if param.is_meta:
        return  # built on the meta device: filled after sharding (common.materialize)
    gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
    full = fn(full_shape(param), gen)
    param.copy_(shard_tensor(full, param).to(dtype=param.dtype))


def init_parameters(model: torch.nn.Module, seed: int) -> None:
    """Initialise every parameter of ``model`` from its init rule, TP-invariantly (see module doc)."""
    for name, param in model.named_parameters():
        init_parameter(param, name, seed)
