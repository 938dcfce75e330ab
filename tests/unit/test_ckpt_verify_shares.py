"""Checkpoint verification split over ranks: each rank reads an equal share of the bytes, the pieces' CRC-32s
join into each file's (checked against zlib over the whole file), and every world size names the same first
damaged file as a single reader."""

from __future__ import annotations

import os
import random
import zlib

import pytest

from leangrpo_mcore.engine.checkpoint import manifest


def test_crc32_combine_matches_zlib_over_the_concatenation():
    rng = random.Random(0)
    for length1, length2 in [(0, 0), (0, 5), (7, 0), (1, 1), (13, 1000), (4096, 3), (100_003, 77_777)]:
        a, b = rng.randbytes(length1), rng.randbytes(length2)
        assert manifest.crc32_combine(zlib.crc32(a), zlib.crc32(b), length2) == zlib.crc32(a + b)


def _checkpoint(root, sizes: dict[str, int]) -> dict[str, dict]:
    rng = random.Random(1)
    for rel, size in sizes.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(rng.randbytes(size))
    files = manifest.describe(str(root), sorted(sizes))
    manifest.write_marker(str(root), 3, files)
    return files


SIZES = {"dcp/__0_0.distcp": 300_001, "dcp/__1_0.distcp": 299_999, "dcp/.metadata": 1_234, "empty.txt": 0,
         "rng/rank_0.pt": 1_500, "trainer_state.json": 10}


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_each_rank_reads_an_equal_share_and_all_of_it_once(tmp_path, world):
    files = _checkpoint(tmp_path, SIZES)
    total = sum(SIZES.values())
    covered = {rel: [0] * size for rel, size in SIZES.items()}
    for rank in range(world):
        pieces = manifest.share_of(files, rank, world)
        assert abs(sum(length for _, _, length in pieces) - total / world) <= 1
        for rel, start, length in pieces:
            for i in range(start, start + length):
                covered[rel][i] += 1
    assert all(count == 1 for counts in covered.values() for count in counts)


def _judged(root, world: int):
    return manifest.judge(str(root), [manifest.check_share(str(root), rank, world) for rank in range(world)])


def test_the_ranks_agree_with_a_single_reader(tmp_path):
    _checkpoint(tmp_path, SIZES)
    for world in (1, 2, 3, 7):
        assert _judged(tmp_path, world) is None
    # One flipped byte near the end of the first data file: read by the last rank of 2, the second of 3.
    path = tmp_path / "dcp" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[299_000] ^= 0x01
    path.write_bytes(bytes(data))
    expected = f"{zlib.crc32(bytes(data)) & 0xFFFFFFFF:08x}"
    for world in (1, 2, 3, 7):
        problem = _judged(tmp_path, world)
        assert problem is not None and problem.startswith("dcp/__0_0.distcp is damaged"), (world, problem)
        assert f"checksum {expected}," in problem
    assert manifest.verify(str(tmp_path)) == _judged(tmp_path, 3)


def test_missing_and_resized_files_are_named_in_name_order(tmp_path):
    _checkpoint(tmp_path, SIZES)
    (tmp_path / "rng" / "rank_0.pt").unlink()
    with open(tmp_path / "trainer_state.json", "ab") as fh:
        fh.write(b"x")
    for world in (1, 4):
        assert _judged(tmp_path, world) == "rng/rank_0.pt is missing"
    (tmp_path / "COMPLETE").write_text("{not json")
    assert _judged(tmp_path, 2) == "COMPLETE is unreadable (JSONDecodeError)"
