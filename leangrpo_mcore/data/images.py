"""The image pipeline for reward inputs and image datasets: decode -> resize -> center crop -> normalise.

Two backends produce the same tensors, selected by ``data.image_backend``: NVIDIA DALI (``dali``; CPU pipelines
with ``device_id=None``, GPU pipelines with the mixed decoder where CUDA exists) and PIL + torch (``pil``);
``auto`` takes DALI when it imports. Both resize the shorter side to ``size`` with an antialiased bilinear
filter (DALI ``INTERP_LINEAR`` + ``antialias``; PIL ``BILINEAR``, which widens its support when shrinking),
round the longer side half up and place the center crop with offsets rounded half up, as DALI does, so the
geometry is identical and only the resampling arithmetic differs (measured mean |diff| < 1/255).
Output: float32 (B, 3, crop_h, crop_w) = (pixel / 255 − mean) / std.

:func:`preprocess_tensor` applies the same transform to float images (B, 3, H, W) in [0, 1], e.g. decoded
samples on their way to a reward model.
"""

from __future__ import annotations

import io
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from leangrpo_mcore.errors import UserError

BACKENDS = ("auto", "dali", "pil")
ImageSource = Union[str, Path, bytes, bytearray, memoryview]
# CLIP's normalisation (PickScore, HPS, ImageReward and CLIP-score reward models use it).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageTransform:
    """Resize the shorter side to ``size``, center-crop ``crop`` (h, w; default size × size), normalise."""

    size: int
    crop: Optional[tuple[int, int]] = None
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"resize size must be >= 1, got {self.size}")
        crop = (self.size, self.size) if self.crop is None else tuple(int(c) for c in self.crop)
        if len(crop) != 2 or not all(1 <= c <= self.size for c in crop):
            raise ValueError(f"crop must be two ints in [1, {self.size}], got {self.crop}")
        object.__setattr__(self, "crop", crop)
        if len(self.mean) != 3 or len(self.std) != 3 or any(s <= 0 for s in self.std):
            raise ValueError(f"mean and std must be 3 values each, std > 0; got {self.mean}, {self.std}")


def resized_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(h, w) with the shorter side ``size`` and the longer scaled, rounded half up (DALI's rounding)."""
    if height <= width:
        return size, math.floor(width * size / height + 0.5)
    return math.floor(height * size / width + 0.5), size


def center_crop_offsets(height: int, width: int, crop: tuple[int, int]) -> tuple[int, int]:
    """(top, left) of a centered ``crop`` window, rounded half up (DALI's crop_pos 0.5)."""
    return math.floor((height - crop[0]) / 2 + 0.5), math.floor((width - crop[1]) / 2 + 0.5)


def _normalise(images: torch.Tensor, transform: ImageTransform) -> torch.Tensor:
    mean = torch.tensor(transform.mean, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(transform.std, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    return (images - mean) / std


def preprocess_tensor(images: torch.Tensor, transform: ImageTransform) -> torch.Tensor:
    """Float images (B, 3, H, W) in [0, 1] -> float32 (B, 3, crop_h, crop_w), resized (antialiased bilinear),
    center-cropped and normalised like the file pipelines."""
    if images.ndim != 4 or images.shape[1] != 3 or not images.dtype.is_floating_point:
        raise ValueError(f"images must be float (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
    images = images.float()
    new_h, new_w = resized_size(images.shape[2], images.shape[3], transform.size)
    if (new_h, new_w) != tuple(images.shape[2:]):
        images = F.interpolate(images, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = center_crop_offsets(new_h, new_w, transform.crop)
    images = images[:, :, top:top + transform.crop[0], left:left + transform.crop[1]]
    return _normalise(images, transform)


def dali_available() -> bool:
    """True when NVIDIA DALI and its PyTorch plugin import."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 -- a broken install is as unusable as a missing one
        return False
    return True


def resolve_image_backend(name: str) -> str:
    """``auto`` -> ``dali`` if it imports, else ``pil``; ``dali`` without DALI is a one-line UserError."""
    if name not in BACKENDS:
        raise ValueError(f"unknown image backend {name!r}; valid: {', '.join(BACKENDS)}")
    if name == "auto":
        return "dali" if dali_available() else "pil"
    if name == "dali" and not dali_available():
        raise UserError("data.image_backend=dali but NVIDIA DALI is not installed (pip install nvidia-dali-cuda120)")
    return name


def _read_source(source: ImageSource) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    path = Path(source)
    if not path.is_file():
        raise UserError(f"image file not found: {path}")
    return path.read_bytes()


class PILImagePipeline:
    """The transform on PIL (decode, resize) and torch (crop, normalise); CPU tensors out."""

    backend = "pil"

    def __init__(self, transform: ImageTransform) -> None:
        """Pipeline for ``transform``."""
        self.transform = transform

    def _one(self, data: bytes, index: int) -> torch.Tensor:
        try:
            image = Image.open(io.BytesIO(data)).convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise UserError(f"image pipeline (pil) cannot decode image {index}: {exc}") from None
        new_h, new_w = resized_size(image.height, image.width, self.transform.size)
        if (new_h, new_w) != (image.height, image.width):
            image = image.resize((new_w, new_h), Image.BILINEAR)
        top, left = center_crop_offsets(new_h, new_w, self.transform.crop)
        image = image.crop((left, top, left + self.transform.crop[1], top + self.transform.crop[0]))
        return torch.from_numpy(np.array(image, dtype=np.float32)).permute(2, 0, 1) / 255.0

    def __call__(self, sources: Sequence[ImageSource]) -> torch.Tensor:
        """Encoded images (file paths or bytes) -> float32 (B, 3, crop_h, crop_w)."""
        if not sources:
            raise ValueError("the image pipeline needs at least one image")
        images = torch.stack([self._one(_read_source(s), i) for i, s in enumerate(sources)])
        return _normalise(images, self.transform)


def _dali_graph(transform: ImageTransform, encoded: Any, gpu: bool) -> Any:
    from nvidia.dali import fn, types

    images = fn.decoders.image(encoded, device="mixed" if gpu else "cpu", output_type=types.RGB)
    images = fn.resize(images, resize_shorter=transform.size, interp_type=types.INTERP_LINEAR, antialias=True)
    return fn.crop_mirror_normalize(
        images,
        crop=transform.crop,
        mean=[255.0 * m for m in transform.mean],
        std=[255.0 * s for s in transform.std],
        dtype=types.FLOAT,
        output_layout="CHW",
    )


def _dali_device(device: str | torch.device) -> tuple[torch.device, Optional[int]]:
    device = torch.device(device)
    if device.type == "cuda":
        return device, device.index if device.index is not None else torch.cuda.current_device()
    if device.type != "cpu":
        raise ValueError(f"DALI pipelines run on cpu or cuda, got {device}")
    return device, None


def _to_torch(output: Any, device: torch.device) -> torch.Tensor:
    from nvidia.dali.plugin.pytorch import feed_ndarray

    dense = output.as_tensor()
    result = torch.empty(tuple(dense.shape()), dtype=torch.float32, device=device)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    feed_ndarray(dense, result, cuda_stream=stream)
    return result


class DALIImagePipeline:
    """The transform as a DALI pipeline fed with encoded bytes; tensors on ``device`` (cpu or cuda)."""

    backend = "dali"

    def __init__(
        self, transform: ImageTransform, *, device: str | torch.device = "cpu", max_batch_size: int = 32,
        num_threads: Optional[int] = None,
    ) -> None:
        """Pipeline for ``transform``; batches larger than ``max_batch_size`` run in chunks."""
        resolve_image_backend("dali")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.transform = transform
        self.device, self.device_id = _dali_device(device)
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads or max(1, min(4, os.cpu_count() or 1))
        self._pipe: Any = None
        self._lock = threading.Lock()

    def _build(self) -> Any:
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(
            batch_size=self.max_batch_size, num_threads=self.num_threads, device_id=self.device_id,
            prefetch_queue_depth=1, exec_pipelined=False, exec_async=False,
        )
        def graph() -> Any:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            return _dali_graph(self.transform, encoded, self.device_id is not None)

        pipe = graph()
        pipe.build()
        return pipe

    def _run(self, chunk: list[bytes]) -> torch.Tensor:
        if self._pipe is None:
            self._pipe = self._build()
        try:
            self._pipe.feed_input("encoded", [np.frombuffer(data, dtype=np.uint8) for data in chunk])
            (output,) = self._pipe.run()
        except RuntimeError as exc:
            # A failed DALI pipeline is no longer usable: drop it so that the next call builds a fresh one.
            self._pipe = None
            reason = next((line.strip() for line in str(exc).splitlines() if "failure" in line.lower()), "")
            raise UserError(f"image pipeline (dali) cannot decode the batch: {reason or 'decoder error'}") from None
        return _to_torch(output, self.device)

    def __call__(self, sources: Sequence[ImageSource]) -> torch.Tensor:
        """Encoded images (file paths or bytes) -> float32 (B, 3, crop_h, crop_w) on the pipeline's device."""
        if not sources:
            raise ValueError("the image pipeline needs at least one image")
        data = [_read_source(s) for s in sources]
        with self._lock:
            chunks = [data[i:i + self.max_batch_size] for i in range(0, len(data), self.max_batch_size)]
            return torch.cat([self._run(chunk) for chunk in chunks])


def build_image_pipeline(
    backend: str, transform: ImageTransform, *, device: str | torch.device = "cpu"
) -> PILImagePipeline | DALIImagePipeline:
    """The pipeline of ``data.image_backend`` (auto | dali | pil); the PIL one always returns CPU tensors."""
    if resolve_image_backend(backend) == "dali":
        return DALIImagePipeline(transform, device=device)
    return PILImagePipeline(transform)


def iter_image_batches(
    paths: Sequence[str | Path], batch_size: int, transform: ImageTransform, *, backend: str = "auto",
    device: str | torch.device = "cpu",
) -> Iterator[torch.Tensor]:
    """Batches (≤ ``batch_size``, last one partial) of an image dataset in file order. DALI reads the files
    with ``fn.readers.file`` and iterates with ``DALIGenericIterator``; PIL decodes them in Python."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    files = [str(p) for p in paths]
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise UserError(f"image file not found: {missing[0]}")
    if not files:
        return
    if resolve_image_backend(backend) == "pil":
        pipeline = PILImagePipeline(transform)
        for start in range(0, len(files), batch_size):
            yield pipeline(files[start:start + batch_size])
        return
    yield from _dali_file_batches(files, batch_size, transform, device)


def _dali_file_batches(
    files: list[str], batch_size: int, transform: ImageTransform, device: str | torch.device
) -> Iterator[torch.Tensor]:
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    _, device_id = _dali_device(device)

    @pipeline_def(batch_size=batch_size, num_threads=max(1, min(4, os.cpu_count() or 1)), device_id=device_id)
    def graph() -> Any:
        encoded, _ = fn.readers.file(files=files, random_shuffle=False, name="reader")
        return _dali_graph(transform, encoded, device_id is not None)

    iterator = DALIGenericIterator(
        [graph()], ["images"], reader_name="reader", last_batch_policy=LastBatchPolicy.PARTIAL
    )
    for batch in iterator:
        # The iterator refills the same tensors on later batches: hand out copies.
        yield batch[0]["images"].clone()
