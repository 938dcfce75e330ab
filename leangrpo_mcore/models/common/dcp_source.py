"""Read tensors of a ``torch.distributed.checkpoint`` directory one at a time, in one process, without a launch.

A training checkpoint stores the policy under the keys ``model/<parameter name>``; :class:`DCPSource` exposes
them as a :class:`~leangrpo_mcore.models.common.tensor_source.TensorSource`, so that ``leangrpo-convert`` and
``model.path`` read a training checkpoint like any other policy directory. Each read fetches only the bytes of
the requested tensor (or of its TP slice), never the optimizer state stored beside it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from leangrpo_mcore.models.common.tensor_source import CheckpointError, TensorSource, _one_line
from leangrpo_mcore.models.common.dcp_blocks import Block, BlockLoadPlanner, BlockTensor, quiet_dcp
from leangrpo_mcore.models.common.tp import is_tp_partitioned, shard_range

METADATA_FILE = ".metadata"


def read_dcp_metadata(folder: Path):
    """The DCP metadata of ``folder``; CheckpointError naming the file when it is absent or unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - pickle and storage errors of many kinds
        raise CheckpointError(f"{path} is unreadable ({_one_line(exc)})") from None


def dcp_load(folder: Path, state: dict) -> None:
    """Fill ``state`` (flat: plain tensors or :class:`BlockTensor`) from ``folder`` in this process only."""
    import torch.distributed.checkpoint as dcp

    with quiet_dcp():
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), planner=BlockLoadPlanner(),
                     no_dist=True)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read {sorted(state)[:1]} from {folder} ({_one_line(exc)})") from None


class DCPSource(TensorSource):
    """The tensors stored under ``prefix`` in a DCP directory, read lazily and one at a time."""

    def __init__(self, folder: Path, prefix: str = "model/") -> None:
        super().__init__({})
        self.folder, self.prefix = Path(folder), prefix
        self._meta = {key[len(prefix):]: value
                      for key, value in read_dcp_metadata(self.folder).state_dict_metadata.items()
                      if key.startswith(prefix)}

    def keys(self) -> list[str]:
        """Tensor names (without the prefix), sorted."""
        return sorted(self._meta)

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def _entry(self, key: str):
        if key not in self._meta:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint {self.folder}")
        return self._meta[key]

    def shape(self, key: str) -> torch.Size:
        """The stored (full) shape of ``key``."""
        return torch.Size(self._entry(key).size)

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of ``key``."""
        return self._entry(key).properties.dtype

    def get(self, key: str) -> torch.Tensor:
        """The full tensor ``key``."""
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        dcp_load(self.folder, {self.prefix + key: out})
        return out

    def get_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box of ``key`` at ``offsets`` of ``sizes``; reads only the chunks that overlap it."""
        if len(self.shape(key)) == 0:
            return self.get(key)
        out = torch.empty(sizes, dtype=self.dtype(key))
        dcp_load(self.folder, {self.prefix + key: BlockTensor(tuple(self.shape(key)), [Block(tuple(offsets), out)],
                                                              self.dtype(key))})
        return out

    def get_shard(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of ``key`` for the parameter ``like``; reads only that slice."""
        if not is_tp_partitioned(like):
            return self.get(key)
        shape, dim = list(self.shape(key)), like.partition_dim
        start, stop = shard_range(like, shape[dim])
        piece = list(shape)
        piece[dim] = stop - start
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        out = torch.empty(piece, dtype=self.dtype(key))
        dcp_load(self.folder, {self.prefix + key: BlockTensor(tuple(shape), [Block(offsets, out)], self.dtype(key))})
        return out
