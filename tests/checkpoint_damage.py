"""Damage a real training checkpoint the ways storage does, for the tests of every checkpoint consumer: a flipped
bit inside a weight tensor's stored bytes, a truncated shard, a missing ``COMPLETE`` marker."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

DAMAGES = ("flipped_bit", "truncated_shard", "missing_complete")


def weight_bytes(checkpoint: Path) -> tuple[str, str, int, int]:
    """(parameter name, data file relpath, offset, length) of the largest stored policy weight: where its bytes
    sit in a ``dcp/__<rank>_<n>.distcp`` file (DCP's own metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint / "dcp")).read_metadata()
    chunks = [(index, info) for index, info in metadata.storage_data.items() if index.fqn.startswith("model/")
              and index.fqn.endswith(".weight")]
    index, info = max(chunks, key=lambda item: item[1].length)
    return index.fqn[len("model/"):], f"dcp/{info.relative_path}", int(info.offset), int(info.length)


def stored_weight(checkpoint: Path, name: str) -> torch.Tensor:
    """The weight ``name`` as the checkpoint's DCP files hold it (read without any verification)."""
    from leangrpo_mcore.models.common.dcp_source import DCPSource

    return DCPSource(checkpoint / "dcp").get(name)


def damage(source: Path, target: Path, how: str) -> str:
    """Copy the checkpoint ``source`` to ``target`` and damage the copy ``how`` (one of :data:`DAMAGES`); returns
    the relpath of the file damaged (``COMPLETE`` for the missing marker)."""
    shutil.copytree(source, target)
    if how == "missing_complete":
        os.remove(target / "COMPLETE")
        return "COMPLETE"
    name, rel, offset, length = weight_bytes(target)
    path = target / rel
    data = bytearray(path.read_bytes())
    if how == "flipped_bit":
        data[offset + length // 2] ^= 0x10  # the middle of the tensor's stored bytes: its values, not a header
        path.write_bytes(bytes(data))
        assert not torch.equal(stored_weight(target, name), stored_weight(source, name)), "the bit missed the data"
    elif how == "truncated_shard":
        path.write_bytes(bytes(data[:offset + length // 2]))
    else:
        raise ValueError(how)
    return rel
