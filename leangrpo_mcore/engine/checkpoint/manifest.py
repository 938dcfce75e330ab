"""The ``COMPLETE`` marker of a training checkpoint: every file with its size and CRC-32, verified on resume.

The marker is written last, after every rank's files are on disk, so its presence says the checkpoint was
finished and its content says what "finished" was: a truncated, emptied or altered file (a full disk, a bad
copy, a storage fault) no longer matches and the checkpoint is refused or, under ``checkpoint.resume=auto``,
skipped. Each rank checksums the files it wrote itself, so a save reads nothing twice.

Verification is split the same way: :func:`verify_on_ranks` gives each rank an equal, contiguous share of the
checkpoint's bytes (files in name order, cut at byte offsets, so a checkpoint written at another world size
splits as evenly), each rank computes the CRC-32 of its pieces, and one ``all_gather`` brings every piece to
every rank, which joins them per file (:func:`crc32_combine`, zlib's method) and names the same first damaged
file. At world size N each rank reads 1/N of the checkpoint instead of rank 0 reading all of it.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from leangrpo_mcore.engine.output.run_dir import MARKER

_CHUNK = 8 << 20


def crc32(path: str) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits."""
    value = 0
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(_CHUNK)
            if not chunk:
                break
            value = zlib.crc32(chunk, value)
    return f"{value & 0xFFFFFFFF:08x}"


def describe(root: str, relpaths: list[str]) -> dict[str, dict]:
    """``{relpath: {"bytes": size, "crc32": digest}}`` of files under ``root``."""
    return {rel: {"bytes": os.path.getsize(os.path.join(root, rel)), "crc32": crc32(os.path.join(root, rel))}
            for rel in relpaths}


def files_under(root: str) -> list[str]:
    """Every regular file below ``root``, as sorted paths relative to it (the marker excluded)."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), root)
            if rel != MARKER:
                found.append(rel)
    return sorted(found)


def write_marker(root: str, step: int, files: dict[str, dict]) -> None:
    """Write the marker (fsynced) listing ``files``."""
    path = os.path.join(root, MARKER)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"step": step, "files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[row]) for row in range(32)]


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc1`` = CRC-32(A), ``crc2`` = CRC-32(B) and ``length2`` = len(B) (zlib's
    ``crc32_combine``: appending ``length2`` zero bytes is a linear map over GF(2), applied by squaring)."""
    if length2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # first pass: one zero byte
        if length2 & 1:
            crc1 = _gf2_times(even, crc1)
        length2 >>= 1
        if not length2:
            break
        odd = _gf2_square(even)
        if length2 & 1:
            crc1 = _gf2_times(odd, crc1)
        length2 >>= 1
        if not length2:
            break
    return crc1 ^ crc2


def share_of(files: dict[str, dict], rank: int, world: int) -> list[tuple[str, int, int]]:
    """``(relpath, start, length)`` pieces of rank ``rank``'s equal, contiguous share of the listed bytes (files
    in name order)."""
    total = sum(int(entry["bytes"]) for entry in files.values())
    lo, hi = rank * total // world, (rank + 1) * total // world
    pieces, offset = [], 0
    for rel in sorted(files):
        size = int(files[rel]["bytes"])
        start, end = max(lo, offset), min(hi, offset + size)
        if start < end:
            pieces.append((rel, start - offset, end - start))
        offset += size
    return pieces


def _crc_of_range(path: str, start: int, length: int) -> int:
    value, left = 0, length
    with open(path, "rb") as fh:
        fh.seek(start)
        while left:
            chunk = fh.read(min(_CHUNK, left))
            if not chunk:
                raise EOFError(path)
            value = zlib.crc32(chunk, value)
            left -= len(chunk)
    return value


@dataclass
class ShareCheck:
    """What one rank found in its share of a checkpoint."""

    marker_problem: Optional[str] = None
    """Why the marker could not be used (every rank reads it), or None."""
    problems: dict[str, str] = field(default_factory=dict)
    """relpath -> a missing file, a wrong size, or a read failure."""
    pieces: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """relpath -> (start, length, CRC-32) of each piece read."""


def read_marker(root: str) -> tuple[Optional[dict[str, dict]], Optional[str]]:
    """The marker's ``{relpath: {"bytes", "crc32"}}``, or None and the reason as a short phrase."""
    try:
        with open(os.path.join(root, MARKER), encoding="utf-8") as fh:
            files = json.load(fh)["files"]
    except FileNotFoundError:
        return None, f"no {MARKER} marker"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{MARKER} is unreadable ({type(err).__name__})"
    if not isinstance(files, dict) or not files:
        return None, f"{MARKER} lists no files"
    if not all(isinstance(e, dict) and isinstance(e.get("bytes"), int) and e["bytes"] >= 0 for e in files.values()):
        return None, f"{MARKER} is unreadable (a file without its size)"
    return files, None


def check_share(root: str, rank: int, world: int) -> ShareCheck:
    """Rank ``rank``'s part of verifying ``root``: every file's presence and size, and its share's CRC-32s."""
    files, problem = read_marker(root)
    if files is None:
        return ShareCheck(marker_problem=problem)
    check = ShareCheck()
    for rel, entry in sorted(files.items()):
        target = os.path.join(root, rel)
        if not os.path.isfile(target):
            check.problems[rel] = f"{rel} is missing"
        elif os.path.getsize(target) != entry["bytes"]:
            check.problems[rel] = f"{rel} has {os.path.getsize(target)} bytes, {entry['bytes']} were written"
    for rel, start, length in share_of(files, rank, world):
        if rel in check.problems:
            continue
        try:
            crc = _crc_of_range(os.path.join(root, rel), start, length)
        except (OSError, EOFError) as err:
            check.problems[rel] = f"{rel} is unreadable ({getattr(err, 'strerror', None) or 'truncated'})"
            continue
        check.pieces.setdefault(rel, []).append((start, length, crc))
    return check


def judge(root: str, checks: list[ShareCheck]) -> Optional[str]:
    """The first problem of the checkpoint (files in name order) from every rank's :class:`ShareCheck`."""
    for check in checks:
        if check.marker_problem:
            return check.marker_problem
    files, problem = read_marker(root)
    if files is None:
        return problem
    for rel in sorted(files):
        found = next((c.problems[rel] for c in checks if rel in c.problems), None)
        if found:
            return found
        pieces = sorted(piece for c in checks for piece in c.pieces.get(rel, []))
        value = 0
        for _, length, crc in pieces:
            value = crc32_combine(value, crc, length)
        digest = f"{value & 0xFFFFFFFF:08x}"
        if digest != files[rel].get("crc32"):
            return f"{rel} is damaged (checksum {digest}, {files[rel].get('crc32')} was written)"
    return None


def verify(root: str) -> Optional[str]:
    """None when the checkpoint at ``root`` matches its marker, else the first problem, as a short phrase (this
    process reads every file)."""
    return judge(root, [check_share(root, 0, 1)])


def verify_on_ranks(root: str) -> Optional[str]:
    """Collective over the default process group: :func:`verify` with each rank reading its share of the bytes;
    every rank returns the same answer."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return verify(root)
    world = dist.get_world_size()
    mine = check_share(root, dist.get_rank(), world)
    checks: list[Optional[ShareCheck]] = [None] * world
    dist.all_gather_object(checks, mine)
    return judge(root, checks)
