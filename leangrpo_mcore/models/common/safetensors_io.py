"""Read a box of one tensor from a ``.safetensors`` file with positioned reads, not a memory map.

A memory-mapped read leaves every touched page of the file in the process's resident set until the file is
closed, so reading each rank's slices of a 24 GB checkpoint through a map would count half the file against
each rank. :func:`read_box` reads only the byte ranges of the rows the box covers (``os.pread``, through the
page cache but not the process), and keeps nothing.

The format: an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}``
(offsets relative to the end of the header), then the row-major data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute file offset of the first byte."""


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of a safetensors file; ValueError (one line) for a file that is not one."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short for a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 << 20:
            raise ValueError(f"{path} announces a {length}-byte header (not a safetensors file?)")
        header = json.loads(fh.read(length))
    base = 8 + length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        out[name] = Entry(_DTYPES[info["dtype"]], tuple(int(s) for s in info["shape"]),
                          base + int(info["data_offsets"][0]))
    return out


def read_box(path: Path, entry: Entry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The box of a tensor at ``offsets`` of ``sizes``: one positioned read per contiguous run of rows."""
    shape = entry.shape
    if not shape:
        offsets, sizes = (), ()
    item = torch.empty((), dtype=entry.dtype).element_size()
    # The trailing dimensions read whole form one contiguous run per index of the leading ones.
    split = len(shape)
    while split > 0 and offsets[split - 1] == 0 and sizes[split - 1] == shape[split - 1]:
        split -= 1
    run_dims = shape[split:]
    run = math.prod(run_dims) if split < len(shape) else 1
    if split == 0:
        lead_boxes = [()]
    else:
        # Read the last partial dimension as a range, so a run is sizes[split-1] * run elements.
        lead = [range(o, o + s) for o, s in zip(offsets[:split - 1], sizes[:split - 1])]
        lead_boxes = _product(lead)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out = torch.empty(sizes, dtype=entry.dtype)
    flat = out.view(-1) if out.numel() else out
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        for index in lead_boxes:
            first = sum(i * strides[d] for d, i in enumerate(index))
            if split > 0:
                first += offsets[split - 1] * strides[split - 1]
                count = sizes[split - 1] * run
            else:
                count = run
            nbytes = count * item
            data = os.pread(fd, nbytes, entry.start + first * item)
            if len(data) != nbytes:
                raise ValueError(f"{path} is truncated (wanted {nbytes} bytes at {entry.start + first * item})")
            flat[pos:pos + count] = torch.frombuffer(bytearray(data), dtype=entry.dtype)
            pos += count
    finally:
        os.close(fd)
    return out


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [prefix + (i,) for prefix in out for i in r]
    return out
