"""This rank's pieces of a parameter-shaped tensor, in the coordinates of the FULL tensor, for
``torch.distributed.checkpoint`` (DCP).

A parameter here is sharded twice: megatron tensor parallelism slices the FULL tensor along ``partition_dim``
into contiguous slices, then FSDP2 shards dimension 0 of that TP slice as a DTensor over the data-parallel mesh.
The piece a rank holds is therefore one box of the TP slice, which is one box of the FULL tensor.

:class:`BlockTensor` presents those boxes to DCP through the protocol DTensor itself uses
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``): each box is a chunk of the
FULL tensor. DCP then writes every rank's boxes without any gather, deduplicates the boxes that replicas hold
in common (data-parallel replicas, TP-replicated weights), and on load intersects the boxes of the new layout
with the stored ones. That is what makes a checkpoint load at any world size, FSDP2 degree and TP degree.

The boxes are views of the rank's own storage: saving reads them, loading writes into them in place.

Opaque values (a module's serialized extra state, see :mod:`leangrpo_mcore.engine.checkpoint.extra_state`) travel as
``bytes`` on save, written as they are, and are read back into a ``bytearray`` of the load state dict.

Trust: DCP's ``dcp/.metadata`` is a Python pickle, unpickled by every load (a resume, ``model.path`` at a
checkpoint, ``leangrpo-convert``), so a crafted checkpoint can run code, as PyTorch's own documentation warns
of ``torch.load``-style formats; load only checkpoints from sources you trust.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor



@dataclass(frozen=True)
class Block:
    """A box of the FULL tensor held by this rank: its offsets there and a view of the local data."""

    offsets: tuple[int, ...]
    data: torch.Tensor


class BlockTensor:
    """A FULL tensor of ``shape`` of which this rank holds ``blocks`` (possibly none)."""

    def __init__(self, shape: tuple[int, ...], blocks: list[Block], dtype: torch.dtype) -> None:
        self.shape = torch.Size(shape)
        self.blocks = [b for b in blocks if b.data.numel() > 0]
        self.dtype = dtype

    def size(self) -> torch.Size:
        """The FULL shape (DCP compares it with the stored one)."""
        return self.shape

    def _chunk(self, block: Block) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(block.offsets), sizes=block.data.shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(b),
                                                      properties=TensorProperties.create_from_tensor(b.data),
                                                      size=self.shape))
                for b in self.blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(b) for b in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for block in self.blocks:
            if torch.Size(block.offsets) == index.offset:
                return block.data
        raise ValueError(f"no block of {index.fqn} at offset {tuple(index.offset or ())}")


def tp_boxes(local_shape: tuple[int, ...], local_offsets: tuple[int, ...], data: torch.Tensor, stub: torch.Tensor,
             tp_rank: int, tp_size: int) -> tuple[tuple[int, ...], list[Block]]:
    """The FULL shape and the box of ``data``, a box at ``local_offsets`` of a TP slice of ``local_shape``.

    ``stub`` carries the megatron TP attributes of the parameter (``tensor_model_parallel``, ``partition_dim``).
    """
    local_shape = tuple(local_shape)
    if not getattr(stub, "tensor_model_parallel", False) or tp_size == 1:
        return local_shape, [Block(tuple(local_offsets), data)]
    dim = stub.partition_dim
    full_shape = list(local_shape)
    full_shape[dim] *= tp_size
    offsets = list(local_offsets)
    offsets[dim] += tp_rank * local_shape[dim]
    return tuple(full_shape), [Block(tuple(offsets), data)]


def block_tensor(tensor: torch.Tensor, stub: torch.Tensor, tp_rank: int, tp_size: int) -> BlockTensor:
    """``tensor`` (a TP slice, plain or an FSDP2 DTensor) as this rank's boxes of the FULL tensor."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = tensor.to_local()
        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    else:
        local, offsets = tensor, (0,) * tensor.ndim
    shape, blocks = tp_boxes(tuple(tensor.shape), tuple(offsets), local.detach(), stub, tp_rank, tp_size)
    return BlockTensor(shape, blocks, local.dtype)


def _lookup(state_dict: dict, index: MetadataIndex) -> Any:
    obj = state_dict[index.fqn]
    if isinstance(obj, BlockTensor):
        return obj.__get_tensor_shard__(index)
    return None


class BlockSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, aware of :class:`BlockTensor` values."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """``bytes`` are written raw (DCP would pickle them), so that reading them back unpickles nothing. DCP's
        own ``.metadata`` file is still a pickle that every load unpickles: a checkpoint must come from a trusted
        source (docs/checkpoints.md, "Trust")."""
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, bytes):
            return io.BytesIO(object)
        return super().transform_object(write_item, object)


class BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, aware of :class:`BlockTensor` values (loaded in place).

    The state dict must be flat (``{key: value}``): DCP's own set-up replaces values of types it does not
    know, so the blocks are set aside while it runs.
    """

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        blocks = {k: v for k, v in state_dict.items() if isinstance(v, BlockTensor)}
        self.byte_targets = {k: v for k, v in state_dict.items() if isinstance(v, bytearray)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in blocks}, metadata, is_coordinator)
        self.state_dict.update(blocks)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Fill a ``bytearray`` target with the stored bytes as they are; other values as DCP does."""
        target = self.byte_targets.get(read_item.dest_index.fqn)
        if target is None:
            super().load_bytes(read_item, value)
        else:
            target[:] = value.read()

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """Hide DCP's warning that it runs in one process (intended, for offline reads)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
