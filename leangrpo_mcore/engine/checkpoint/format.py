"""What a training checkpoint directory holds: its file names, format version, and the readers of its small files.

Every module of :mod:`~leangrpo_mcore.engine.checkpoint` builds on these: the names below, this process's rank
and world size (1 without a process group), and fsynced JSON writes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch.distributed as dist

from leangrpo_mcore.engine.output.run_dir import MARKER, STEP_DIR, RunDir
from leangrpo_mcore.errors import UserError

STATE_FILE = "trainer_state.json"
OPTIM_FILE = "optimizer.json"
FORMAT = "leangrpo_mcore.train_checkpoint"
VERSION = 3
"""3: the policy's fused q/k/v and FLUX's single-block ``proj_out`` in their per-head layouts. Modules' extra
state (``extra/`` keys) came later without a bump: its entries sit beside the others, so a version-3 checkpoint
without them still loads (with a warning for modules that keep extra state) and older readers skip them."""


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read checkpoint file {path}: {getattr(err, 'strerror', None) or err}") from None


def list_complete(run_dir: RunDir) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint with a marker, oldest first (not yet verified)."""
    found = []
    for name in run_dir.existing_checkpoints():
        match = STEP_DIR.match(name)
        path = os.path.join(run_dir.checkpoints_dir, name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_state(path: str) -> dict:
    """The ``trainer_state.json`` of a complete checkpoint; UserError when it is missing or foreign."""
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(state_path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {path} is unreadable: {STATE_FILE}: {err}") from None
    if state.get("format") != FORMAT or int(state.get("version", -1)) != VERSION:
        raise UserError(f"checkpoint {path} is not a leangrpo_mcore training checkpoint of version {VERSION}")
    return state


def saved_config(path: str) -> Optional[dict]:
    """The resolved config (as a dict) of the run that wrote the checkpoint, or None when unreadable."""
    import yaml

    try:
        with open(os.path.join(path, "config.yaml"), encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None
