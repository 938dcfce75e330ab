import io

import numpy as np
import pytest
import torch
from PIL import Image

from leangrpo_mcore.data import images as images_mod
from leangrpo_mcore.data.images import (
    CLIP_MEAN,
    CLIP_STD,
    ImageTransform,
    PILImagePipeline,
    build_image_pipeline,
    center_crop_offsets,
    dali_available,
    iter_image_batches,
    preprocess_tensor,
    resized_size,
    resolve_image_backend,
)
from leangrpo_mcore.errors import UserError

needs_dali = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not importable")
# (height, width): landscape, square, half-way rounding of the long side and of the crop offset, upscaling.
SIZES = [(64, 80), (48, 48), (32, 41), (97, 33), (20, 30), (90, 70)]


def _pixels(height, width, seed):
    """A smooth pattern plus 20 % noise: realistic content where resampling filters matter."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([x * 255 / width, y * 255 / height, 128 + 127 * np.sin(x / 3) * np.cos(y / 5)], -1)
    return (0.8 * base + 0.2 * 255 * rng.random((height, width, 3))).clip(0, 255).astype(np.uint8)


def _encode(pixels, fmt):
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def test_geometry_rounds_half_up():
    assert resized_size(64, 82, 48) == (48, 62)  # 61.5 -> 62
    assert resized_size(96, 95, 48) == (49, 48)
    assert resized_size(30, 20, 10) == (15, 10)
    assert center_crop_offsets(48, 61, (48, 48)) == (0, 7)  # 6.5 -> 7
    assert center_crop_offsets(141, 48, (48, 48)) == (47, 0)


def test_pil_crop_and_normalisation_are_exact_without_resize():
    pixels = _pixels(24, 40, 0)
    transform = ImageTransform(size=24, crop=(16, 20), mean=CLIP_MEAN, std=CLIP_STD)
    out = PILImagePipeline(transform)([_encode(pixels, "PNG")])
    top, left = center_crop_offsets(24, 40, (16, 20))
    window = torch.from_numpy(pixels[top:top + 16, left:left + 20].astype(np.float32)).permute(2, 0, 1) / 255
    expected = (window - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    assert out.shape == (1, 3, 16, 20) and out.dtype == torch.float32
    assert torch.allclose(out[0], expected, rtol=0, atol=1e-6)


def test_tensor_path_matches_pil_path():
    transform = ImageTransform(size=32)
    sources = [_encode(_pixels(h, w, i), "PNG") for i, (h, w) in enumerate(SIZES)]
    from_files = PILImagePipeline(transform)(sources)
    for i, (h, w) in enumerate(SIZES):
        tensor = torch.from_numpy(_pixels(h, w, i)).permute(2, 0, 1)[None].float() / 255
        out = preprocess_tensor(tensor, transform)
        assert out.shape == (1, 3, 32, 32)
        # torch's antialiased bilinear and PIL's BILINEAR differ by rounding only (measured mean 0.3/255).
        assert (out[0] - from_files[i]).abs().mean() < 1.0 / 255
    with pytest.raises(ValueError, match=r"float \(B, 3, H, W\)"):
        preprocess_tensor(torch.zeros(1, 4, 8, 8), transform)


@needs_dali
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_dali_cpu_pipeline_equals_pil_within_tolerance(fmt, tmp_path):
    transform = ImageTransform(size=32, crop=(32, 28), mean=CLIP_MEAN, std=CLIP_STD)
    encoded = [_encode(_pixels(h, w, i), fmt) for i, (h, w) in enumerate(SIZES)]
    (tmp_path / "first.img").write_bytes(encoded[0])
    sources = [tmp_path / "first.img"] + encoded[1:]
    dali = images_mod.DALIImagePipeline(transform, max_batch_size=4)  # 6 images: two chunks
    out = dali(sources)
    reference = PILImagePipeline(transform)(sources)
    assert out.shape == reference.shape == (len(SIZES), 3, 32, 28) and out.device.type == "cpu"
    # Same geometry, different resampling arithmetic: measured per-image mean |diff| <= 0.72/255 and
    # max |diff| <= 7/255 (in pixel units); the checks leave a margin. Normalisation divides by std ~0.27.
    diff_pixels = (out - reference).abs() * torch.tensor(CLIP_STD).view(1, 3, 1, 1) * 255
    assert diff_pixels.mean(dim=(1, 2, 3)).max() < 1.5
    assert diff_pixels.max() < 12
    again = dali(sources[:2])  # the pipeline is reusable with another batch size
    assert torch.equal(again, out[:2])


@needs_dali
def test_dali_file_iterator_and_decode_errors(tmp_path):
    transform = ImageTransform(size=16)
    paths = []
    for i, (h, w) in enumerate(SIZES[:5]):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(_encode(_pixels(h, w, i), "PNG"))
    dali_batches = list(iter_image_batches(paths, 2, transform, backend="dali"))
    pil_batches = list(iter_image_batches(paths, 2, transform, backend="pil"))
    assert [b.shape[0] for b in dali_batches] == [b.shape[0] for b in pil_batches] == [2, 2, 1]
    for d, p in zip(dali_batches, pil_batches, strict=True):
        assert (d - p).abs().mean() < 1.5 / 255
    assert resolve_image_backend("auto") == "dali"
    pipeline = build_image_pipeline("dali", transform)
    with pytest.raises(UserError, match="image pipeline \\(dali\\) cannot decode the batch") as info:
        pipeline([b"definitely not an image"])
    assert "\n" not in str(info.value)
    assert pipeline([paths[0]]).shape == (1, 3, 16, 16)  # rebuilt after the failure


def test_backend_selection_and_errors(monkeypatch, tmp_path):
    transform = ImageTransform(size=8)
    assert isinstance(build_image_pipeline("pil", transform), PILImagePipeline)
    monkeypatch.setattr(images_mod, "dali_available", lambda: False)
    assert resolve_image_backend("auto") == "pil"
    with pytest.raises(UserError, match="data.image_backend=dali but NVIDIA DALI is not installed"):
        resolve_image_backend("dali")
    with pytest.raises(ValueError, match="valid: auto, dali, pil"):
        resolve_image_backend("opencv")
    with pytest.raises(UserError, match="cannot decode image 1"):
        PILImagePipeline(transform)([_encode(_pixels(8, 8, 0), "PNG"), b"junk"])
    with pytest.raises(UserError, match="image file not found"):
        PILImagePipeline(transform)([tmp_path / "missing.png"])
    with pytest.raises(UserError, match="image file not found"):
        list(iter_image_batches([tmp_path / "missing.png"], 2, transform, backend="pil"))
    with pytest.raises(ValueError, match="crop must be two ints"):
        ImageTransform(size=8, crop=(9, 8))
