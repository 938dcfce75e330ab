"""Resume verification at world size 2: each rank reads half of the checkpoint's bytes, both ranks reach the same
answer with one collective, a damaged explicit checkpoint is the same one-line error on every rank naming the
file, and ``auto`` sets a damaged newest checkpoint aside and resumes the previous one."""

from __future__ import annotations

import os
import random

import pytest

from leangrpo_mcore.engine.checkpoint import manifest
from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

SIZES = {"dcp/__0_0.distcp": 200_000, "dcp/__1_0.distcp": 200_000, "dcp/.metadata": 3_000,
         "trainer_state.json": 40}


def _make(path: str, seed: int) -> None:
    rng = random.Random(seed)
    for rel, size in SIZES.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as fh:
            fh.write(rng.randbytes(size))
    manifest.write_marker(path, seed, manifest.describe(path, sorted(SIZES)))


def _on_rank(rank: int, world: int, root: str) -> dict:
    from leangrpo_mcore.engine import checkpoint
    from leangrpo_mcore.engine.output.run_dir import RunDir
    from leangrpo_mcore.errors import UserError

    read = []
    crc_of_range = manifest._crc_of_range

    def counting(path, start, length):
        read.append(length)
        return crc_of_range(path, start, length)

    manifest._crc_of_range = counting
    run_dir = RunDir(root)
    good, bad = run_dir.checkpoint_path(2), run_dir.checkpoint_path(4)
    result = {"intact": manifest.verify_on_ranks(good), "bytes_read": sum(read)}
    try:
        checkpoint.resolve_resume(bad, run_dir)
        result["explicit"] = None
    except UserError as err:
        result["explicit"] = str(err)
    warnings = []
    result["auto"] = checkpoint.resolve_resume("auto", run_dir, warn=warnings.append)
    result["warnings"] = warnings
    result["left"] = sorted(os.listdir(run_dir.checkpoints_dir))
    return result


def test_each_rank_verifies_half_and_both_agree(tmp_path):
    root = tmp_path / "run"
    for step in (2, 4):
        _make(str(root / "checkpoints" / f"step_{step}"), step)
    target = root / "checkpoints" / "step_4" / "dcp" / "__1_0.distcp"
    data = bytearray(target.read_bytes())
    data[150_000] ^= 0x80  # in rank 1's half
    target.write_bytes(bytes(data))
    results = run_ranks(_on_rank, 2, str(root), timeout=120)
    total = sum(SIZES.values())
    for r in results:
        assert r["intact"] is None
        assert abs(r["bytes_read"] - total / 2) <= 1  # its half of the intact checkpoint
    explicit = {r["explicit"] for r in results}
    assert len(explicit) == 1
    line = explicit.pop()
    assert line.startswith(f"checkpoint.resume: {root / 'checkpoints' / 'step_4'} fails verification: "
                           "dcp/__1_0.distcp is damaged (checksum "), line
    assert results[0]["auto"] == results[1]["auto"] == str(root / "checkpoints" / "step_2")
    assert len(results[0]["warnings"]) == 1 and "dcp/__1_0.distcp is damaged" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []  # rank 0 alone renames and reports
    assert results[0]["left"][0] == "step_2" and results[0]["left"][1].startswith("step_4.damaged-")
