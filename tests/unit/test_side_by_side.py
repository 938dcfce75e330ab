"""[source | result] tiles of image-conditioned runs: images and videos (the source beside every frame of the mp4)."""

import numpy as np
import pytest

from leangrpo_mcore.engine.output.samples import SOURCE_GAP, beside_sources
from leangrpo_mcore.engine.output.video import write_video_grid

iio = pytest.importorskip("imageio.v3", reason="the 'video' extra is not installed")


def _uint8(*shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def test_images_and_videos_get_their_source_on_the_left():
    images, sources = _uint8(2, 8, 6, 3), _uint8(2, 8, 6, 3, seed=1)
    tiles = beside_sources(images, sources)
    assert tiles.shape == (2, 8, 2 * 6 + SOURCE_GAP, 3)
    assert np.array_equal(tiles[:, :, :6], sources) and np.array_equal(tiles[:, :, 6 + SOURCE_GAP:], images)
    assert (tiles[:, :, 6:6 + SOURCE_GAP] == 255).all()
    videos = _uint8(2, 5, 8, 6, 3, seed=2)
    clips = beside_sources(videos, sources)
    assert clips.shape == (2, 5, 8, 2 * 6 + SOURCE_GAP, 3)
    assert all(np.array_equal(clips[:, k, :, :6], sources) for k in range(5))
    assert np.array_equal(clips[:, :, :, 6 + SOURCE_GAP:], videos)
    small = _uint8(2, 4, 3, 3, seed=3)  # a source of another size is scaled to the sample's, nearest neighbours
    assert np.array_equal(beside_sources(images, small)[:, :, :6], small.repeat(2, axis=1).repeat(2, axis=2))
    with pytest.raises(ValueError, match="do not pair up"):
        beside_sources(images, sources[:1])


def test_mp4_grid_shows_the_source_beside_every_frame(tmp_path):
    flat = np.zeros((1, 5, 32, 32, 3), dtype=np.uint8)
    flat[..., 1] = np.linspace(40, 200, 5, dtype=np.uint8)[None, :, None, None]  # the clip brightens
    source = np.full((1, 32, 32, 3), (200, 60, 60), dtype=np.uint8)
    write_video_grid(str(tmp_path / "v.mp4"), beside_sources(flat, source), ["edit"], [0.5], fps=4)
    decoded = iio.imread(str(tmp_path / "v.mp4")).astype(np.int64)
    scale = -(-128 // (2 * 32 + SOURCE_GAP))  # the grid upscales a tile to at least 128 pixels
    left = decoded[:, 2 + 8:2 + 32 * scale - 8, 2 + 8:2 + 32 * scale - 8]  # inside the source, away from edges
    right = decoded[:, 2 + 8:2 + 32 * scale - 8, 2 + (32 + SOURCE_GAP) * scale + 8:2 + (2 * 32 + SOURCE_GAP) * scale - 8]
    assert np.abs(left.mean(axis=(1, 2)) - [200, 60, 60]).max() < 6  # H.264 keeps a flat colour within a few levels
    greens = right[..., 1].mean(axis=(1, 2))
    assert np.all(np.diff(greens) > 20)  # the result changes frame by frame beside the unchanging source
