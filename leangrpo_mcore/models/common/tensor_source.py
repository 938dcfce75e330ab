"""Lazy, TP-slicing reads of named tensors: :class:`TensorSource` over safetensors files, :class:`MemorySource`
over tensors in memory, and :class:`CheckpointError`, the one-line error of every checkpoint reader.

Shared by the policy-format and diffusers readers (:mod:`~leangrpo_mcore.models.common.checkpoint`) and the
training-checkpoint reader (:mod:`~leangrpo_mcore.models.common.dcp_source`), which both build on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.common.tp import is_tp_partitioned, shard_range, shard_tensor


class CheckpointError(UserError):
    """A checkpoint is missing, of the wrong kind or corrupt (the message is one line)."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({_one_line(exc)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


class TensorSource:
    """Lazy access to named tensors spread over one or more safetensors files."""

    def __init__(self, key_to_file: dict[str, Path]) -> None:
        self._key_to_file = dict(key_to_file)
        self._handles: dict[Path, object] = {}

    @classmethod
    def from_file(cls, path: Path) -> "TensorSource":
        """All tensors of one ``.safetensors`` file."""
        source = cls({})
        source._key_to_file = {key: Path(path) for key in source._handle(Path(path)).keys()}
        return source

    @classmethod
    def from_index(cls, index_path: Path) -> "TensorSource":
        """Tensors listed by a sharded index (``weight_map``: name -> file next to the index)."""
        index = _read_json(Path(index_path))
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map")
        folder = Path(index_path).parent
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise CheckpointError(f"{index_path} names missing shard files: {', '.join(missing)}")
        return cls({key: folder / name for key, name in weight_map.items()})

    def _handle(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open

            if not path.is_file():
                raise CheckpointError(f"{path} does not exist")
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{path} is not a readable safetensors file ({_one_line(exc)})") from None
        return self._handles[path]

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self._key_to_file

    def _slice(self, key: str):
        if key not in self._key_to_file:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint")
        path = self._key_to_file[key]
        try:
            return self._handle(path).get_slice(key)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read {key!r} from {path} ({_one_line(exc)})") from None

    def shape(self, key: str) -> torch.Size:
        """The stored (full) shape of ``key``."""
        return torch.Size(self._slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        """The full tensor ``key``."""
        self._slice(key)
        try:
            return self._handle(self._key_to_file[key]).get_tensor(key)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read {key!r} ({_one_line(exc)})") from None

    def get_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box of ``key`` at ``offsets`` of ``sizes``, read with positioned reads of only its rows (no memory
        map, so the file's pages never count against this process; see ``safetensors_io``)."""
        from leangrpo_mcore.models.common import safetensors_io

        if key not in self._key_to_file:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint")
        path = self._key_to_file[key]
        headers = self.__dict__.setdefault("_headers", {})
        try:
            if path not in headers:
                headers[path] = safetensors_io.read_header(path)
            return safetensors_io.read_box(path, headers[path][key], tuple(offsets), tuple(sizes))
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read {key!r} from {path} ({_one_line(exc)})") from None

    def get_shard(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of ``key`` for the parameter ``like``; reads only that slice."""
        if not is_tp_partitioned(like):
            return self.get(key)
        view, dim = self._slice(key), like.partition_dim
        shape = view.get_shape()
        start, stop = shard_range(like, shape[dim])
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
        try:
            return view[index]
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read {key!r} ({_one_line(exc)})") from None


class MemorySource(TensorSource):
    """A :class:`TensorSource` over FULL tensors already in memory (e.g. a converted state dict)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__({})
        self._tensors = dict(tensors)

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def shape(self, key: str) -> torch.Size:
        """The stored (full) shape of ``key``."""
        return self._tensors[key].shape

    def get(self, key: str) -> torch.Tensor:
        """The full tensor ``key``."""
        return self._tensors[key]

    def get_shard(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of ``key`` for the parameter ``like``."""
        return shard_tensor(self._tensors[key], like)

    def get_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box of ``key`` at ``offsets`` of ``sizes``."""
        tensor = self._tensors[key]
        for dim, (start, size) in enumerate(zip(offsets, sizes)):
            tensor = tensor.narrow(dim, start, size)
        return tensor


class PrefixedSource(TensorSource):
    """Several sources as one, each one's names under its own prefix (a pipeline's ``transformer.`` and
    ``transformer_2.`` components read as one set of tensors)."""

    def __init__(self, sources: dict[str, TensorSource]) -> None:
        super().__init__({})
        self._sources = dict(sources)

    def _find(self, key: str) -> tuple[TensorSource, str]:
        for prefix, source in self._sources.items():
            if key.startswith(prefix) and key[len(prefix):] in source:
                return source, key[len(prefix):]
        raise CheckpointError(f"tensor {key!r} is not in the checkpoint")

    def keys(self) -> list[str]:
        """Tensor names (prefixed), sorted."""
        return sorted(prefix + key for prefix, source in self._sources.items() for key in source.keys())

    def __contains__(self, key: str) -> bool:
        return any(key.startswith(p) and key[len(p):] in s for p, s in self._sources.items())

    def shape(self, key: str) -> torch.Size:
        """The stored (full) shape of ``key``."""
        source, inner = self._find(key)
        return source.shape(inner)

    def get(self, key: str) -> torch.Tensor:
        """The full tensor ``key``."""
        source, inner = self._find(key)
        return source.get(inner)

    def get_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box of ``key`` at ``offsets`` of ``sizes``."""
        source, inner = self._find(key)
        return source.get_box(inner, offsets, sizes)

    def get_shard(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of ``key`` for the parameter ``like``."""
        source, inner = self._find(key)
        return source.get_shard(inner, like)
