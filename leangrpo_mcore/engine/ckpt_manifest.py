"""The ``COMPLETE`` marker of a training checkpoint: every file with its size and CRC-32, verified on resume.

The marker is written last, after every rank's files are on disk, so its presence says the checkpoint was
finished and its content says what "finished" was: a truncated, emptied or altered file (a full disk, a bad
copy, a storage fault) no longer matches and the checkpoint is refused or, under ``checkpoint.resume=auto``,
skipped. Each rank checksums the files it wrote itself, so a save reads nothing twice.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Optional

MARKER = "COMPLETE"
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


def verify(root: str) -> Optional[str]:
    """None when the checkpoint at ``root`` matches its marker, else the first problem, as a short phrase."""
    path = os.path.join(root, MARKER)
    try:
        with open(path, encoding="utf-8") as fh:
            files = json.load(fh)["files"]
    except FileNotFoundError:
        return f"no {MARKER} marker"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MARKER} is unreadable ({type(err).__name__})"
    if not isinstance(files, dict) or not files:
        return f"{MARKER} lists no files"
    for rel, entry in sorted(files.items()):
        target = os.path.join(root, rel)
        if not os.path.isfile(target):
            return f"{rel} is missing"
        size = os.path.getsize(target)
        if size != entry.get("bytes"):
            return f"{rel} has {size} bytes, {entry.get('bytes')} were written"
        try:
            digest = crc32(target)
        except OSError as err:
            return f"{rel} is unreadable ({err.strerror})"
        if digest != entry.get("crc32"):
            return f"{rel} is damaged (checksum {digest}, {entry.get('crc32')} was written)"
    return None
