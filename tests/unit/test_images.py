"""Conditioning images read by DALI: PIL's decode + resize + centre crop within a uint8 level, the same next images
after a resume, one line naming the file and row of a bad one, (no DALI in a run without images: test_import_graph)."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.once import once_per_process
import torch
from PIL import Image

from leangrpo_mcore.data.images import ConditioningImages, ImageFiles, ImageReader, ResizeCrop
from leangrpo_mcore.data.prompts import PromptDataset, PromptSampler
from leangrpo_mcore.errors import UserError

pytest.importorskip("nvidia.dali", reason="DALI (nvidia-dali-cuda120, in the 'dali' and 'test' extras) is not installed")

SIZES = [(97, 61), (60, 80), (300, 400), (480, 360), (64, 64), (37, 50)]
TARGETS = [(64, 64), (32, 48), (96, 64)]


def picture(height: int, width: int, seed: int) -> np.ndarray:
    """(H, W, 3) uint8: gradients, a sinusoid, a hard-edged block and mild noise (a photograph's ingredients)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    image = np.stack([128 + 100 * np.sin(x / 5.0 + y / 7.0), 128 + 100 * np.cos(x / 9.0), x * 255 / width], -1)
    image[height // 3:height // 2, width // 4:width // 2] = (250, 20, 90)
    return (image + rng.normal(0, 4, image.shape)).clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
@once_per_process
def files(tmp_path_factory) -> list[Path]:
    """JPEGs and PNGs of several sizes and aspect ratios, a grayscale JPEG and an RGBA PNG."""
    root = tmp_path_factory.mktemp("images")
    out = []
    for k, (h, w) in enumerate(SIZES):
        image = Image.fromarray(picture(h, w, k))
        for suffix, options in ((".jpg", {"quality": 92}), (".png", {})):
            out.append(root / f"p{k}{suffix}")
            image.save(out[-1], **options)
    Image.fromarray(picture(90, 70, 9)).convert("L").save(root / "gray.jpg")
    rgba = np.dstack([picture(50, 90, 10), np.full((50, 90, 1), 100, np.uint8)])
    Image.fromarray(rgba).save(root / "rgba.png")
    return out + [root / "gray.jpg", root / "rgba.png"]


def test_dali_matches_pil_decode_resize_and_crop_within_a_level(files):
    """Against diffusers' VaeImageProcessor.resize(..., resize_mode="crop") (PIL Lanczos, then the centre): within
    one uint8 level, and equal for all but a fraction of a percent of the values (measured: 1213 of 494592 differ,
    by one). DALI tabulates its Lanczos kernel (weights up to 2e-4 off PIL's), which can move a pass's rounding by a
    level; on photographs two levels were seen on about one pixel in a million."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=16)
    over_one = total = differ = 0
    worst = 0
    for height, width in TARGETS:
        images = ImageReader(height, width, batch_size=5, threads=1).read(files)
        assert images.shape == (len(files), 3, height, width) and images.dtype == torch.float32
        for path, image in zip(files, images):
            expected = np.asarray(processor.resize(Image.open(path).convert("RGB"), height, width,
                                                   resize_mode="crop")).astype(np.int64)
            got = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.int64)
            gap = np.abs(got - expected)
            worst, total = max(worst, int(gap.max())), total + gap.size
            over_one, differ = over_one + int((gap > 1).sum()), differ + int((gap > 0).sum())
    assert worst <= 1 and over_one == 0, (worst, over_one)
    assert differ / total < 0.01, (differ, total)  # nearly every value is PIL's exactly


def test_an_image_of_the_target_size_passes_unchanged(files, tmp_path):
    exact = picture(32, 48, 3)
    Image.fromarray(exact).save(tmp_path / "exact.png")
    out = ImageReader(32, 48, threads=1).read([tmp_path / "exact.png"])
    assert np.array_equal((out[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), exact)


def test_crop_geometry_is_diffusers_integer_arithmetic():
    assert ResizeCrop.of((97, 61), (64, 64)) == ResizeCrop(101, 64, 101 // 2 - 32, 0, 64, 64)
    assert ResizeCrop.of((60, 80), (32, 48)) == ResizeCrop(36, 48, 18 - 16, 0, 32, 48)
    assert ResizeCrop.of((300, 400), (96, 64)) == ResizeCrop(96, 128, 0, 64 - 32, 96, 64)


def _dataset(root: Path, names: list[str]) -> PromptDataset:
    rows = [{"prompt": f"make picture {k} brighter", "image": name} for k, name in enumerate(names)]
    (root / "train_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset.from_source(root, "train")


def test_resume_mid_epoch_reads_the_same_next_images(files, tmp_path):
    """The images follow the prompt sampler: a sampler restored from a mid-epoch state draws the next prompts of
    the uninterrupted run, and so reads the same images, bit for bit."""
    for path in files[:5]:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    dataset = _dataset(tmp_path, [p.name for p in files[:5]])

    def stream():
        sampler = PromptSampler(len(dataset), 2, seed=7)
        images = ConditioningImages(ImageFiles.of(dataset, "data.prompts"), ImageReader(32, 32, threads=1))
        return sampler, images

    sampler, images = stream()
    uninterrupted = [images.load(sampler.next_indices()) for _ in range(5)]  # crosses two epoch boundaries
    sampler, images = stream()
    for _ in range(2):
        images.load(sampler.next_indices())
    state = json.loads(json.dumps(sampler.state_dict()))  # as a checkpoint stores it
    assert state["offset"] == 4 and state["epoch"] == 0  # mid-epoch
    sampler, images = stream()
    sampler.load_state_dict(state)
    resumed = [images.load(sampler.next_indices()) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[2:]))
    assert not torch.equal(uninterrupted[2], uninterrupted[3])


def test_missing_field_missing_file_and_undecodable_file_name_the_row(files, tmp_path):
    (tmp_path / "a.png").write_bytes(files[1].read_bytes())
    with pytest.raises(UserError, match=r"image .*gone\.png of .*train_metadata\.jsonl row 2 does not exist"):
        ImageFiles.of(_dataset(tmp_path, ["a.png", "gone.png"]), "data.prompts")
    (tmp_path / "train_metadata.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(UserError, match=r"row 1 has no 'image' field"):
        ImageFiles.of(PromptDataset.from_source(tmp_path, "train"), "data.prompts")
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    cut = files[0].read_bytes()
    (tmp_path / "cut.jpg").write_bytes(cut[:len(cut) // 3])  # a valid header, most of the data missing
    dataset = _dataset(tmp_path, ["a.png", "junk.png", "cut.jpg"])
    images = ConditioningImages(ImageFiles.of(dataset, "data.prompts"), ImageReader(16, 16, threads=1))
    assert images.load([0]).shape == (1, 3, 16, 16)
    with pytest.raises(UserError) as junk:
        images.load([0, 1])
    assert "junk.png" in str(junk.value) and "row 2 of" in str(junk.value) and "\n" not in str(junk.value)
    with pytest.raises(UserError) as cut_error:
        images.load([2])
    assert "cut.jpg" in str(cut_error.value) and "row 3 of" in str(cut_error.value)
    assert "\n" not in str(cut_error.value)

