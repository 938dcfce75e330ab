"""How each of our parameters is made of a foreign checkpoint's tensors: one description, every direction.

A family describes its diffusers checkpoint once, as a plan ``{our parameter name: Assembly}``. An
:class:`Assembly` says that our FULL (TP-gathered, FSDP-unsharded) tensor is the concatenation along ``dim`` of
one or more pieces of stored tensors (:class:`Piece`). A piece is either a whole stored tensor viewed with the
shape it takes inside ours (a reshape that keeps its first dimension: Wan's patch-embedding kernel
(D, C, pt, ph, pw) is the linear weight (D, C·pt·ph·pw)), or a slice of a stored tensor along ``dim``
(fused q/k/v interleave the heads of three stored tensors, see :func:`interleave`). Either way a range of ours
along ``dim`` is a range of each stored piece.

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
from typing import Callable, Mapping, Optional, Sequence

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
    """Shape inside ours: the stored tensor reshaped (same first dimension, same element count), or, for a slice,
    the slice's shape."""
    start: Optional[int] = None
    """None: the whole stored tensor. An int: the piece is the slice ``[start, start + shape[dim])`` of the stored
    tensor along the assembly's ``dim`` (no reshape)."""

    def __post_init__(self) -> None:
        if self.start is not None:
            if len(self.shape) != len(self.stored_shape) or self.start < 0:
                raise ValueError(f"piece {self.key}: a slice of {self.stored_shape} cannot have shape {self.shape}")
        elif math.prod(self.stored_shape) != math.prod(self.shape) or (
                self.shape and self.stored_shape and self.shape[0] != self.stored_shape[0]):
            raise ValueError(f"piece {self.key}: {self.stored_shape} cannot be viewed as {self.shape} "
                             "(a piece keeps its first dimension and its size)")

    def read(self, stored: torch.Tensor, dim: int) -> torch.Tensor:
        """This piece (a view) of the stored tensor."""
        if self.start is None:
            return stored.reshape(self.shape)
        return stored.narrow(dim, self.start, self.shape[dim])


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
        for p in self.pieces:
            if p.start is not None and (p.start + p.shape[self.dim] > p.stored_shape[self.dim] or any(
                    a != b for d, (a, b) in enumerate(zip(p.shape, p.stored_shape)) if d != self.dim)):
                raise ValueError(f"piece {p.key}: {p.shape} at {p.start} is not a slice of {p.stored_shape} "
                                 f"along dim {self.dim}")

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


@dataclass(frozen=True)
class Source:
    """A range of a stored tensor along the interleaved dimension, cut into ``groups`` equal units."""

    key: str
    stored_shape: tuple[int, ...]
    start: int
    """First index of the range along the interleaved dimension."""
    size: int
    """Length of the range (``groups`` units)."""


def interleave(sources: Sequence[Source], groups: int, dim: int = 0) -> Assembly:
    """Ours = for each group g, for each source: the g-th unit of that source's range, concatenated along ``dim``.

    With ``groups`` = attention heads this is the per-head layout of megatron-core's fused ``linear_qkv``
    (head 0: q, k, v rows; head 1: q, k, v rows; ...): a contiguous split of ours over TP ranks gives each rank
    whole heads of every source, so standard column / row partitioning applies at any TP size dividing ``groups``.
    """
    pieces = []
    for g in range(groups):
        for src in sources:
            if src.size % groups:
                raise ValueError(f"{src.key}: a range of {src.size} does not split into {groups} groups")
            unit = src.size // groups
            shape = tuple(unit if d == dim else s for d, s in enumerate(src.stored_shape))
            pieces.append(Piece(src.key, tuple(src.stored_shape), shape, start=src.start + g * unit))
    return Assembly(tuple(pieces), dim)


def with_leading(assembly: Assembly, rows: int, rename: Callable[[str], str]) -> Assembly:
    """The same layout along ``assembly.dim`` (> 0) for tensors of ``rows`` rows stored as ``rename(key)``.

    A LoRA ``A`` factor (rank, in) of a host whose weight interleaves its input columns follows that interleave.
    """
    if assembly.dim == 0:
        raise ValueError("with_leading keeps the layout of a dimension other than the first")
    return Assembly(tuple(Piece(rename(p.key), (rows,) + tuple(p.stored_shape[1:]), (rows,) + tuple(p.shape[1:]),
                                start=p.start) for p in assembly.pieces), assembly.dim)


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
        parts = [p.read(tensors[p.key], assembly.dim) for p in assembly.pieces]
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=assembly.dim)
    return out


def disassemble(tensors: Mapping[str, torch.Tensor], plan: Mapping[str, Assembly],
                what: str) -> dict[str, torch.Tensor]:
    """The foreign state dict from our full tensors: the exact inverse of :func:`assemble`."""
    _check(tensors, {name: a.full_shape for name, a in plan.items()}, what)
    out, slices = {}, {}
    for name in sorted(plan):
        assembly = plan[name]
        sizes = [p.shape[assembly.dim] for p in assembly.pieces]
        for piece, part in zip(assembly.pieces, torch.split(tensors[name], sizes, dim=assembly.dim)):
            if piece.start is None:
                out[piece.key] = part.reshape(piece.stored_shape)
            else:
                slices.setdefault(piece.key, []).append((piece, assembly.dim, part))
    for key, parts in slices.items():
        out[key] = _join_slices(key, parts)
    return out


def _join_slices(key: str, parts: list) -> torch.Tensor:
    """The stored tensor ``key`` from its slices (each index covered exactly once)."""
    parts = sorted(parts, key=lambda item: item[0].start)
    piece, dim = parts[0][0], parts[0][1]
    offset = 0
    for p, d, _ in parts:
        if d != dim or p.start != offset:
            raise ValueError(f"the slices of {key} do not tile it along dim {dim}")
        offset += p.shape[dim]
    if offset != piece.stored_shape[dim]:
        raise ValueError(f"the slices of {key} cover {offset} of {piece.stored_shape[dim]} along dim {dim}")
    return torch.cat([part for _, _, part in parts], dim=dim)


JOINT_QKV = {"to_qkv": ("to_q", "to_k", "to_v"), "add_qkv_proj": ("add_q_proj", "add_k_proj", "add_v_proj")}
"""Our fused projections of a joint (MMDiT) attention -> the diffusers projections each concatenates per head."""


def fused_qkv(name: str, shape: Sequence[int], heads: int) -> Optional[Assembly]:
    """The assembly of our fused q/k/v parameter ``name`` (a :data:`JOINT_QKV` projection's weight or bias) from
    diffusers' three projections, heads interleaved; None for any other parameter."""
    prefix, fused, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
    if fused not in JOINT_QKV:
        return None
    stored = (shape[0] // 3,) + tuple(shape[1:])
    sources = [Source(f"{prefix}.{proj}.{kind}", stored, 0, stored[0]) for proj in JOINT_QKV[fused]]
    return interleave(sources, groups=heads)


def meta_shapes(model_cls: Callable, config) -> dict[str, torch.Size]:
    """FULL (tensor-parallel gathered) shape of every parameter of ``model_cls(config)``, built on the meta
    device with local layers (no memory, no initialisation)."""
    import dataclasses

    from leangrpo_mcore.models.common.tp import full_shape

    meta_config = dataclasses.replace(config, perform_initialization=False, use_cpu_initialization=True)
    with torch.device("meta"):
        model = model_cls(meta_config, backend="local")
    return {name: full_shape(param) for name, param in model.named_parameters()}
