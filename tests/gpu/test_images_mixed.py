"""Conditioning images on a GPU (skipped without CUDA or DALI): the ``mixed`` pipeline (nvJPEG with libjpeg-turbo's
fancy chroma upsampling, GPU resampling) lands where the CPU pipeline does, within a uint8 level, on the device."""

import numpy as np
import pytest
import torch
from PIL import Image

from leangrpo_mcore.data.images import ImageReader
from tests.unit.test_images import SIZES, picture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("nvidia.dali", reason="DALI (nvidia-dali-cuda120, in the 'dali' and 'test' extras) is not installed")


def test_mixed_pipeline_matches_the_cpu_one(tmp_path):
    paths = []
    for k, (h, w) in enumerate(SIZES):
        for suffix, options in ((".jpg", {"quality": 92}), (".png", {})):
            paths.append(tmp_path / f"p{k}{suffix}")
            Image.fromarray(picture(h, w, k)).save(paths[-1], **options)
    cpu = ImageReader(64, 48, threads=2).read(paths)
    gpu = ImageReader(64, 48, device="cuda", threads=2).read(paths)
    assert gpu.device.type == "cuda" and gpu.shape == cpu.shape
    gap = ((gpu.cpu() - cpu).abs() * 255).round()
    assert float(gap.max()) <= 1, float(gap.max())
    assert float((gap > 0).float().mean()) < 0.02
    assert np.isfinite(gpu.cpu().numpy()).all()
