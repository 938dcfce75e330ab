"""Box reads of safetensors files with positioned reads equal slicing the loaded tensor; bad files are one line."""

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from leangrpo_mcore.models.common.checkpoint import CheckpointError, TensorSource
from leangrpo_mcore.models.common.safetensors_io import read_box, read_header


def test_every_box_matches_the_slice(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, 3, generator=gen), "b": torch.randn(6, generator=gen).to(torch.bfloat16),
               "c": torch.tensor(3.0), "d": torch.randn(4, 9, generator=gen).to(torch.float16)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    header = read_header(path)
    rng = random.Random(0)
    for key, value in tensors.items():
        if value.ndim == 0:
            assert torch.equal(read_box(path, header[key], (), ()), value)
            continue
        for _ in range(40):
            offsets = [rng.randrange(s) for s in value.shape]
            sizes = [rng.randint(1, s - o) for s, o in zip(value.shape, offsets)]
            expected = value
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                expected = expected.narrow(dim, o, s)
            got = read_box(path, header[key], tuple(offsets), tuple(sizes))
            assert got.dtype == value.dtype and torch.equal(got, expected), (key, offsets, sizes)


def test_truncated_file_is_one_line(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 100)
    source = TensorSource({"w": Path(path)})
    with pytest.raises(CheckpointError, match="cannot read 'w' from .*truncated"):
        source.get_box("w", (60, 0), (4, 64))
    assert source.get_box("w", (0, 0), (2, 64)).shape == (2, 64)  # the intact rows still read
