"""Fill a policy built on the ``meta`` device, after TP and FSDP2 have sharded it, one box at a time.

The policy is constructed on ``meta`` (no memory), its TP slicing is part of the construction, FSDP2 wraps it
on ``meta`` too, and ``to_empty`` then allocates only what this rank holds. Each rank's piece of a parameter is
one or more boxes of the FULL tensor (:func:`~leangrpo_mcore.models.common.dcp_blocks.block_tensor`), and a
:data:`BoxReader` supplies exactly those boxes:

- :func:`random_boxes`: the seeded init rule of the parameter, computed for the box alone (a counter-based
  generator keyed by ``(seed, name)`` and the element's place in the FULL tensor, see
  :mod:`~leangrpo_mcore.models.common.init`: identical at every layout, and each rank draws only what it holds);
- :func:`source_boxes`: a checkpoint in our format (safetensors or a training checkpoint), reading the box only;
- :func:`assembled_boxes`: a diffusers checkpoint through the family's assembly plan, reading from each stored
  piece only the rows and columns the box needs.

No rank holds the full model at any point.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from leangrpo_mcore.models.common.assembly import Assembly
from leangrpo_mcore.models.common.checkpoint import CheckpointError, TensorSource
from leangrpo_mcore.models.common.dcp_blocks import block_tensor
from leangrpo_mcore.models.common.init import InitFn, _INIT_ATTR, param_key
from leangrpo_mcore.models.common.tp import tp_rank, tp_world_size

Box = tuple[tuple[int, ...], tuple[int, ...]]
BoxReader = Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]
"""``read(name, offsets, sizes)`` -> the box of the FULL tensor ``name`` at ``offsets`` of ``sizes``."""


def init_rules(model: torch.nn.Module) -> dict[str, InitFn]:
    """``{parameter name: init rule}``; record it before FSDP2 replaces the parameters (and their attributes)."""
    return {name: getattr(p, _INIT_ATTR) for name, p in model.named_parameters() if hasattr(p, _INIT_ATTR)}


def _narrow(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, start, size)
    return tensor


def random_boxes(rules: Mapping[str, InitFn], full_shapes: Mapping[str, tuple[int, ...]], seed: int) -> BoxReader:
    """Boxes of each parameter's seeded init (``full_shapes``: name -> FULL shape), each computed alone."""

    def read(name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        if name not in rules:
            raise ValueError(f"parameter {name} has no init rule (use common.init.set_init)")
        return rules[name](param_key(seed, name), tuple(full_shapes[name]), offsets, sizes)

    return read


def source_boxes(source: TensorSource) -> BoxReader:
    """Boxes of the tensors of one of our checkpoints (names as the model's)."""
    return lambda name, offsets, sizes: source.get_box(name, offsets, sizes)


def assembled_boxes(source: TensorSource, plan: Mapping[str, Assembly]) -> BoxReader:
    """Boxes of our parameters made of a foreign checkpoint's tensors by ``plan`` (see ``assembly``)."""

    def read(name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        assembly = plan[name]
        dim, parts = assembly.dim, []
        for piece, lo, hi in assembly.pieces_along(offsets[dim], offsets[dim] + sizes[dim]):
            box_offsets = tuple(lo if d == dim else o for d, o in enumerate(offsets))
            box_sizes = tuple(hi - lo if d == dim else s for d, s in enumerate(sizes))
            if piece.start is not None:  # a slice along dim: shift the box into the stored tensor
                shifted = tuple(o + piece.start if d == dim else o for d, o in enumerate(box_offsets))
                parts.append(source.get_box(piece.key, shifted, box_sizes))
            elif tuple(piece.shape) == tuple(piece.stored_shape):
                parts.append(source.get_box(piece.key, box_offsets, box_sizes))
            else:  # a reshaped piece keeps its first dimension: read whole rows, then cut the columns
                rows = source.get_box(piece.key, (box_offsets[0],) + (0,) * (len(piece.stored_shape) - 1),
                                      (box_sizes[0],) + tuple(piece.stored_shape[1:]))
                rows = rows.reshape((box_sizes[0],) + tuple(piece.shape[1:]))
                parts.append(_narrow(rows, (0,) + box_offsets[1:], box_sizes))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    return read


@torch.no_grad()
def fill(model: torch.nn.Module, layout: Mapping[str, torch.Tensor], read: BoxReader,
         only: Optional[set[str]] = None) -> None:
    """Copy this rank's boxes of every parameter (or of the names in ``only``) from ``read``.

    ``layout`` maps each name to a stub with the parameter's TP attributes (recorded before FSDP2 wrapping).
    """
    rank, world = tp_rank(), tp_world_size()
    for name, param in model.named_parameters():
        if only is not None and name not in only:
            continue
        boxes = block_tensor(param, layout[name], rank, world)
        for block in boxes.blocks:
            value = read(name, block.offsets, tuple(block.data.shape))
            if tuple(value.shape) != tuple(block.data.shape):
                raise CheckpointError(f"{name}: read a box of shape {tuple(value.shape)} for "
                                      f"{tuple(block.data.shape)}")
            block.data.copy_(value)
