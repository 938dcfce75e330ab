"""Read tensors of a ``torch.distributed.checkpoint`` directory one at a time, in one process, without a launch.

A training checkpoint stores the policy under the keys ``model/<parameter name>``; :class:`DCPSource` exposes
them as a :class:`~leangrpo_mcore.models.common.tensor_source.TensorSource`, so that ``leangrpo-convert`` and
``model.path`` read a training checkpoint like any other policy directory. Each read fetches only the bytes of
the requested tensor (or of its TP slice), never the optimizer state stored beside it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from leangrpo_mcore.errors import exception_line
from leangrpo_mcore.models.common.tensor_source import CheckpointError, TensorSource
from leangrpo_mcore.models.common.dcp_blocks import Block, BlockLoadPlanner, BlockTensor, quiet_dcp
from leangrpo_mcore.models.common.tp import is_tp_partitioned, shard_range

METADATA_FILE = ".metadata"


def dcp_failure(exc: BaseException) -> str:
    """What went wrong in a DCP read, on one line: torch's ``CheckpointException`` (a ``BaseException``, not an
    ``Exception``) carries each rank's error in ``failures``; the first one is named (an ``EOFError`` is a
    truncated data file; an unpickler or zip stream-reader error a damaged one), with torch's advice cut."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, BaseException):
            exc = first
    if isinstance(exc, EOFError):
        return "truncated (EOFError: the data file ends early)"
    text = exception_line(exc, 200)
    # PytorchStreamReader appends a paragraph on what may have caused a bad archive; its first sentence says it.
    return text.split(". This is an internal miniz error")[0]


def read_dcp_metadata(folder: Path):
    """The DCP metadata of ``folder``; CheckpointError naming the file when it is absent or unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        return FileSystemReader(str(folder)).read_metadata()
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - pickle and storage errors of many kinds
        raise CheckpointError(f"{path} is unreadable ({dcp_failure(exc)})") from None


def data_files(metadata, keys) -> list[str]:
    """The data files (relative to the DCP folder) that hold the stored ``keys``, from the DCP ``metadata``."""
    return sorted({info.relative_path for index, info in (metadata.storage_data or {}).items()
                   if index.fqn in keys})


def dcp_load(folder: Path, state: dict, metadata=None) -> None:
    """Fill ``state`` (flat: plain tensors or :class:`BlockTensor`) from ``folder`` in this process only; a failed
    read is one CheckpointError line naming the key and (with the folder's ``metadata``) its data file."""
    import torch.distributed.checkpoint as dcp

    with quiet_dcp():
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), planner=BlockLoadPlanner(),
                     no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 -- CheckpointException is a BaseException
            files = data_files(metadata, set(state)) if metadata is not None else []
            where = Path(folder) / files[0] if len(files) == 1 else folder
            raise CheckpointError(f"cannot read {sorted(state)[0]} from {where}: {dcp_failure(exc)}") from None


class DCPSource(TensorSource):
    """The tensors stored under ``prefix`` in a DCP directory, read lazily and one at a time."""

    def __init__(self, folder: Path, prefix: str = "model/") -> None:
        super().__init__({})
        self.folder, self.prefix = Path(folder), prefix
        self._metadata = read_dcp_metadata(self.folder)
        self._meta = {key[len(prefix):]: value for key, value in self._metadata.state_dict_metadata.items()
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
        dcp_load(self.folder, {self.prefix + key: out}, self._metadata)
        return out

    def get_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box of ``key`` at ``offsets`` of ``sizes``; reads only the chunks that overlap it."""
        if len(self.shape(key)) == 0:
            return self.get(key)
        out = torch.empty(sizes, dtype=self.dtype(key))
        block = BlockTensor(tuple(self.shape(key)), [Block(tuple(offsets), out)], self.dtype(key))
        dcp_load(self.folder, {self.prefix + key: block}, self._metadata)
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
        block = BlockTensor(tuple(shape), [Block(offsets, out)], self.dtype(key))
        dcp_load(self.folder, {self.prefix + key: block}, self._metadata)
        return out
