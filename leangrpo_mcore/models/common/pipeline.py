"""Pipeline stages: which transformer blocks one stage of a policy owns, and how stages hand over.

megatron-core's convention (``GPTModel(pre_process=..., post_process=...)``): every stage is the same model class
built with fewer modules. The first stage (``pre_process``) owns the embedders, the last (``post_process``) the
output norm and projection, and each owns a contiguous run of the blocks. A stage other than the first receives
the previous stage's output through ``set_input_tensor`` before its forward; a stage other than the last returns
that tensor instead of the velocity. Parameter names are those of the whole model (a stage holding blocks 3..5
names them ``...blocks.3`` to ``...blocks.5``), so a stage's state dict is a subset of the whole model's and
loads from the same checkpoints.

What crosses a boundary is one tensor (megatron-core's schedules send one activation per stage), documented on
each family's model and in ``docs/models.md`` (Pipeline stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch

from leangrpo_mcore.block_split import stage_block_counts


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``rank`` of ``size``: it owns blocks ``[start, stop)`` of ``total`` (the family's execution order)."""

    rank: int
    """This stage's position in the pipeline (0 = first)."""
    size: int
    """Stages in the pipeline (megatron's pipeline-parallel size)."""
    start: int
    """First block owned."""
    stop: int
    """One past the last block owned."""
    total: int
    """Blocks of the whole model."""

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.size and 0 <= self.start < self.stop <= self.total):
            raise ValueError(f"invalid pipeline stage: rank {self.rank} of {self.size}, blocks "
                             f"[{self.start}, {self.stop}) of {self.total}")

    @classmethod
    def whole(cls, total: int) -> "PipelineStage":
        """The single stage of an unsplit model."""
        return cls(rank=0, size=1, start=0, stop=total, total=total)

    @property
    def pre_process(self) -> bool:
        """Owns the embedders (the first stage)."""
        return self.rank == 0

    @property
    def post_process(self) -> bool:
        """Owns the output norm / modulation and projection (the last stage)."""
        return self.rank == self.size - 1

    @property
    def is_whole(self) -> bool:
        """The whole model in one stage."""
        return self.size == 1

    @property
    def blocks(self) -> range:
        """Indices of the owned blocks."""
        return range(self.start, self.stop)

    def owned(self, first: int, count: int) -> range:
        """Local indices of the owned blocks within a run of ``count`` blocks that starts at block ``first``
        (FLUX: the single-stream blocks start after the double-stream ones)."""
        return range(max(self.start - first, 0), max(min(self.stop - first, count), 0))


def split_blocks(total: int, pp: int, sizes: Optional[Sequence[int]] = None) -> list[PipelineStage]:
    """The ``pp`` stages of a model of ``total`` blocks: ``sizes`` blocks each, or an even split.

    An even split that does not divide gives the first ``total % pp`` stages one block more. ValueError (one
    line) when the split is impossible.
    """
    if pp < 1:
        raise ValueError(f"pipeline-parallel size must be at least 1, got {pp}")
    if sizes is None:
        sizes = stage_block_counts(total, pp)  # the planner's split too (block_split has no torch for it)
    sizes = [int(n) for n in sizes]
    if len(sizes) != pp or sum(sizes) != total or min(sizes) < 1:
        raise ValueError(f"pipeline stage sizes {sizes} must be {pp} positive block counts summing to {total}")
    starts = [sum(sizes[:rank]) for rank in range(pp)]
    return [PipelineStage(rank, pp, start, start + n, total) for rank, (start, n) in enumerate(zip(starts, sizes))]


class StageBlocks(torch.nn.Module):
    """A run of blocks registered under their indices in the whole model (``blocks.3``, ``blocks.4``, ...).

    Behaves like the ``ModuleList`` of the whole model for iteration and ``len``; indexing takes the index in
    the whole model, so ``model.layers[4]`` names the same block on the stage that owns it.
    """

    def __init__(self, blocks: Iterable[torch.nn.Module], first: int = 0) -> None:
        super().__init__()
        for offset, block in enumerate(blocks):
            self.add_module(str(first + offset), block)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> torch.nn.Module:
        if str(index) not in self._modules:
            held = ", ".join(self._modules) or "none"
            raise IndexError(f"block {index} is not held here (held: {held})")
        return self._modules[str(index)]


class StageInputMixin:
    """``set_input_tensor`` for the models (megatron-core's name: the schedules call it before each forward)."""

    _stage_input: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor: Union[torch.Tensor, Sequence[Optional[torch.Tensor]], None]) -> None:
        """Hand this stage the previous stage's output (a tensor, or megatron's one-element list) for the next
        forward. The first stage receives None."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"a pipeline stage takes one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self._stage_input = input_tensor

    def _take_stage_input(self, stage: PipelineStage) -> torch.Tensor:
        """The tensor set for this forward (then forgotten, so that a stale one is never reused)."""
        received, self._stage_input = self._stage_input, None
        if received is None:
            raise ValueError(f"pipeline stage {stage.rank} of {stage.size} needs the previous stage's output: "
                             f"call set_input_tensor before forward")
        return received


def check_boundary(received: torch.Tensor, expected: tuple[int, ...], stage: PipelineStage) -> None:
    """ValueError (one line) when the received tensor is not the boundary this stage's inputs imply."""
    if tuple(received.shape) != tuple(expected):
        raise ValueError(f"pipeline stage {stage.rank} expected a boundary tensor of shape {tuple(expected)} from "
                         f"stage {stage.rank - 1}, got {tuple(received.shape)}")
