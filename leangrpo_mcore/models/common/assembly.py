"""How each of our parameters is made of a foreign checkpoint's tensors: one description, every direction.

A family describes its diffusers checkpoint once, as a plan ``{our parameter name: Assembly}``. An
:class:`Assembly` says that our FULL (TP-gathered, FSDP-unsharded) tensor is the concatenation along ``dim`` of
one or more stored tensors (:class:`Piece`), each viewed with the shape it takes inside ours: a reshape of the
stored tensor that keeps its first dimension (Wan's patch-embedding kernel (D, C, pt, ph, pw) is the linear
weight (D, C·pt·ph·pw)), so a row range of ours is a row range of each stored piece.

Everything that moves tensors between the formats derives from the plan, so no direction can drift from another:

- :func:`assemble` builds our full tensors from a full foreign state dict (conversion, in-memory loads);
- :func:`disassemble` is its exact inverse (export; a round trip is bit-exact: only views, splits and concats);
- the sharded readers of checkpoints use :meth:`Assembly.pieces_along` to read only the slices a rank needs.

Names and shapes are checked against the plan before any tensor is touched: a foreign or truncated checkpoint is
one line (missing / unexpected keys, a wrong shape), never a half-converted model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from leangrpo_mcore.errors import UserError


@dataclass(frozen=True)
class Piece:
    """One stored tensor and the shape it takes inside our parameter."""

    key: str
    """Name in the foreign checkpoint."""
    stored_shape: tuple[int, ...]
    """Shape as stored."""
    shape: tuple[int, ...]
    """Shape inside ours: the stored tensor reshaped (same first dimension, same element count)."""

    def __post_init__(self) -> None:
        if math.prod(self.stored_shape) != math.prod(self.shape) or (
                self.shape and self.stored_shape and self.shape[0] != self.stored_shape[0]):
            raise ValueError(f"piece {self.key}: {self.stored_shape} cannot be viewed as {self.shape} "
                             "(a piece keeps its first dimension and its size)")


@dataclass(frozen=True)
class Assembly:
    """Our full tensor = ``torch.cat([piece viewed as piece.shape for piece in pieces], dim)``."""

    pieces: tuple[Piece, ...]
    dim: int = 0

    def __post_init__(self) -> None:
        if not self.pieces:
            raise ValueError("an assembly needs at least one piece")
        ranks = {len(p.shape) for p in self.pieces}
        if len(ranks) != 1 or not 0 <= self.dim < max(ranks.pop(), 1):
            raise ValueError(f"pieces {[p.key for p in self.pieces]} cannot be concatenated along dim {self.dim}")

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of our full tensor."""
        shape = list(self.pieces[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.pieces)
        return tuple(shape)

    def pieces_along(self, start: int, stop: int) -> list[tuple[Piece, int, int]]:
        """``(piece, start, stop)`` in the piece's own coordinates along :attr:`dim` covering ours [start, stop)."""
        out, offset = [], 0
        for piece in self.pieces:
            size = piece.shape[self.dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                out.append((piece, lo - offset, hi - offset))
            offset += size
        return out


def identity(key: str, shape: tuple[int, ...]) -> Assembly:
    """Our parameter is the stored tensor ``key`` as it is."""
    shape = tuple(int(s) for s in shape)
    return Assembly((Piece(key, shape, shape),))


def stored_shapes(plan: Mapping[str, Assembly]) -> dict[str, tuple[int, ...]]:
    """Name -> stored shape of every tensor the plan reads."""
    return {piece.key: piece.stored_shape for assembly in plan.values() for piece in assembly.pieces}


def _check(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise UserError(f"not a {what} state dict for this config: unexpected keys {unexpected[:4]} "
                        f"({len(unexpected)} in all)")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise UserError(f"incomplete {what} state dict: missing keys {missing[:4]} ({len(missing)} in all)")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != tuple(shape):
            raise UserError(f"{what} tensor {name} has shape {got}, the config implies {tuple(shape)}")


def assemble(tensors: Mapping[str, torch.Tensor], plan: Mapping[str, Assembly], what: str) -> dict[str, torch.Tensor]:
    """Our full tensors from a full foreign state dict (views where a parameter is one piece)."""
    _check(tensors, stored_shapes(plan), what)
    out = {}
    for name in sorted(plan):
        assembly = plan[name]
        parts = [tensors[p.key].reshape(p.shape) for p in assembly.pieces]
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=assembly.dim)
    return out


def disassemble(tensors: Mapping[str, torch.Tensor], plan: Mapping[str, Assembly],
                what: str) -> dict[str, torch.Tensor]:
    """The foreign state dict from our full tensors: the exact inverse of :func:`assemble`."""
    _check(tensors, {name: a.full_shape for name, a in plan.items()}, what)
    out = {}
    for name in sorted(plan):
        assembly = plan[name]
        sizes = [p.shape[assembly.dim] for p in assembly.pieces]
        for piece, part in zip(assembly.pieces, torch.split(tensors[name], sizes, dim=assembly.dim)):
            out[piece.key] = part.reshape(piece.stored_shape)
    return out
