"""Conditioning images: each prompt's image file, decoded, resized and cropped by an NVIDIA DALI pipeline.

A prompt dataset with ``data.images: true`` names one image per row: the ``image`` field of its
``*_metadata.jsonl`` line, a path relative to the file's directory (FlowGRPO's edit datasets). Every file must
exist when the run starts (:class:`ImageFiles`); a file that cannot be decoded stops the run at the step that
reads it, in one line naming the file and its row.

:class:`ImageReader` turns files into (B, 3, H, W) images at the run's resolution with the geometry of diffusers'
``VaeImageProcessor.resize(..., resize_mode="crop")`` (what the FLUX.1-Kontext and Wan image pipelines' processors
do): scale the image so that it covers H x W, keeping its aspect ratio, with PIL's Lanczos filter, then cut the
centre. DALI decodes (``cpu``, or ``mixed``: nvJPEG on the GPU) and resamples; to land where PIL does, within one
uint8 level (DALI tabulates its Lanczos kernel, so a pass's rounding can differ by a level; on photographs two
levels were seen on about one pixel in a million):

- the passes are PIL's: horizontal, rounded and clipped to uint8, then vertical;
- PIL renormalises the kernel where it hangs over an edge, DALI's resize repeats the edge pixel. Each pass
  therefore resizes the image padded with zeros (the region of interest is the image itself) and divides by the
  same resize of a mask of ones: the weights of the pixels inside, renormalised, exactly PIL's;
- EXIF orientation is not applied (PIL's ``Image.open`` does not either) and the GPU decoder uses libjpeg-turbo's
  fancy chroma upsampling, as PIL does.

DALI is the ``dali`` extra (``nvidia-dali-cuda120``), imported only when a run reads images.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from leangrpo_mcore.data.prompts import PromptDataset
from leangrpo_mcore.errors import UserError, require_extra

IMAGE_FIELD = "image"
"""The metadata field of a dataset row that names its conditioning image."""
LANCZOS_SUPPORT = 3
"""Lanczos-3: the kernel reaches 3 source pixels each side (times the scale when downsampling)."""


@dataclass(frozen=True)
class ResizeCrop:
    """Where one image goes: scaled to ``(height, width)``, then the ``(out_height, out_width)`` window at ``(top,
    left)`` is kept (diffusers' ``VaeImageProcessor._resize_and_crop`` integer arithmetic)."""

    height: int
    width: int
    top: int
    left: int
    out_height: int
    out_width: int

    @classmethod
    def of(cls, source: tuple[int, int], target: tuple[int, int]) -> ResizeCrop:
        """The geometry of a ``source`` (height, width) image cut to ``target`` (height, width)."""
        (h, w), (out_h, out_w) = source, target
        wider = out_w / out_h > w / h
        scaled_w = out_w if wider else w * out_h // h
        scaled_h = out_h if not wider else h * out_w // w
        return cls(scaled_h, scaled_w, scaled_h // 2 - out_h // 2, scaled_w // 2 - out_w // 2, out_h, out_w)


def _pad(scale: float) -> int:
    """Zero padding that holds a Lanczos-3 kernel hanging over an edge at ``scale`` source pixels per output one."""
    return math.ceil(LANCZOS_SUPPORT * max(scale, 1.0)) + 2


def _pass_arguments(source: tuple[int, int], geometry: ResizeCrop) -> dict[str, np.ndarray]:
    """The per-image arguments of the two resampling passes (see :func:`_pipeline`), float32 (H, W) pairs."""
    (h, w), out_w = source, geometry.width
    pad_x, pad_y = _pad(w / geometry.width), _pad(h / geometry.height)
    crop_h, crop_w = geometry.out_height, geometry.out_width
    f = lambda *values: np.array(values, dtype=np.float32)  # noqa: E731
    return {
        # horizontal: (h, w) padded to (h, w + 2 pad_x), resampled to (h, out_w), the crop's columns kept
        "x_anchor": f(0, -pad_x), "x_shape": f(h, w + 2 * pad_x), "x_size": f(h, out_w),
        "x_roi_start": f(0, pad_x), "x_roi_end": f(h, pad_x + w), "x_crop": f(0, geometry.left),
        "x_crop_shape": f(h, crop_w),
        # vertical: (h, crop_w) padded to (h + 2 pad_y, crop_w), resampled to (out_h, crop_w), the crop's rows kept
        "y_anchor": f(-pad_y, 0), "y_shape": f(h + 2 * pad_y, crop_w), "y_size": f(geometry.height, crop_w),
        "y_roi_start": f(pad_y, 0), "y_roi_end": f(pad_y + h, crop_w), "y_crop": f(geometry.top, 0),
        "y_crop_shape": f(crop_h, crop_w),
    }


PASS_ARGUMENTS = tuple(_pass_arguments((2, 2), ResizeCrop(2, 2, 0, 0, 2, 2)))
"""Names of the per-image pass arguments (the pipeline's external sources besides the encoded files)."""


def _resample(fn, types, dmath, image, args: dict, axis: str):
    """One PIL resampling pass along ``axis`` ("x" or "y"): renormalised at the edges, rounded to uint8, cropped."""
    options = dict(interp_type=types.INTERP_LANCZOS3, antialias=True, dtype=types.FLOAT, roi_relative=False)
    window = dict(axis_names="HW", normalized_anchor=False, normalized_shape=False)

    def padded(tensor):
        return fn.slice(tensor, args[f"{axis}_anchor"], args[f"{axis}_shape"], out_of_bounds_policy="pad",
                        fill_values=0, **window)

    def resized(tensor):
        return fn.resize(padded(tensor), size=args[f"{axis}_size"], roi_start=args[f"{axis}_roi_start"],
                         roi_end=args[f"{axis}_roi_end"], **options)

    ones = fn.cast(image * 0 + 1, dtype=types.UINT8)
    levels = fn.cast(dmath.clamp(resized(image) / resized(ones), 0, 255), dtype=types.UINT8)
    return fn.slice(levels, args[f"{axis}_crop"], args[f"{axis}_crop_shape"], out_of_bounds_policy="error", **window)


def _pipeline(batch_size: int, device_id: Optional[int], threads: int):
    """The DALI pipeline: encoded files + pass arguments -> (H, W, 3) uint8 images (module doc)."""
    dali = require_extra("nvidia.dali", "dali", "conditioning images (data.images)")
    from nvidia.dali import fn, types
    import nvidia.dali.math as dmath

    pipe = dali.Pipeline(batch_size=batch_size, num_threads=threads, device_id=device_id, prefetch_queue_depth=1)
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        args = {name: fn.external_source(name=name, dtype=types.FLOAT) for name in PASS_ARGUMENTS}
        gpu = device_id is not None
        image = fn.decoders.image(encoded, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                  adjust_orientation=False, **({"jpeg_fancy_upsampling": True} if gpu else {}))
        image = _resample(fn, types, dmath, image, args, "x")
        pipe.set_outputs(_resample(fn, types, dmath, image, args, "y"))
    pipe.build()
    return pipe


class ImageReader:
    """Image files -> (B, 3, H, W) float32 images in [0, 1] at ``height`` x ``width``, by DALI (module doc).

    On a CUDA ``device`` the pipeline decodes with nvJPEG (``mixed``) on that GPU and the images stay there; on the
    CPU every operator is a CPU one. At most ``batch_size`` files go through the pipeline at once.
    """

    def __init__(self, height: int, width: int, *, device: torch.device | str = "cpu", batch_size: int = 8,
                 threads: Optional[int] = None) -> None:
        if height < 1 or width < 1 or batch_size < 1:
            raise ValueError(f"an image reader needs a positive size and batch, got {height}x{width}, {batch_size}")
        self.height, self.width, self.batch_size = height, width, batch_size
        self.device = torch.device(device)
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._pipe: Any = None

    def _run(self, encoded: list[np.ndarray], sizes: list[tuple[int, int]]) -> torch.Tensor:
        if self._pipe is None:
            gpu = self.device.type == "cuda"
            device_id = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
                if gpu else None
            self._pipe = _pipeline(self.batch_size, device_id, self.threads)
        per_image = [_pass_arguments(size, ResizeCrop.of(size, (self.height, self.width))) for size in sizes]
        self._pipe.feed_input("encoded", encoded)
        for name in PASS_ARGUMENTS:
            self._pipe.feed_input(name, [args[name] for args in per_image])
        try:
            (out,) = self._pipe.run()
        except RuntimeError:
            self._pipe = None  # DALI leaves a pipeline that failed unusable
            raise
        return _to_torch(out, self.device)

    def read(self, paths: Sequence[str | os.PathLike]) -> torch.Tensor:
        """(len(paths), 3, H, W) float32 in [0, 1] on the reader's device. A file that cannot be read or decoded
        is an OSError / ValueError naming it (PIL reads each file's header for its size; DALI decodes)."""
        from PIL import Image, UnidentifiedImageError

        chunks = []
        for start in range(0, len(paths), self.batch_size):
            chunk = [Path(p) for p in paths[start:start + self.batch_size]]
            encoded, sizes = [], []
            for path in chunk:
                encoded.append(np.fromfile(path, dtype=np.uint8))
                try:
                    with Image.open(path) as header:
                        sizes.append((header.height, header.width))
                except (UnidentifiedImageError, OSError) as err:
                    raise ValueError(f"{path} is not an image PIL or DALI can read ({err})") from None
            try:
                chunks.append(self._run(encoded, sizes))
            except RuntimeError as err:
                raise ValueError(_undecodable(chunk, err)) from None
        return torch.cat(chunks) if chunks else torch.empty(0, 3, self.height, self.width, device=self.device)


def _to_torch(out, device: torch.device) -> torch.Tensor:
    """A DALI batch of (H, W, 3) uint8 images as (B, 3, H, W) float32 in [0, 1] on ``device``."""
    tensor = out.as_tensor()
    if device.type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        pixels = torch.empty(tuple(tensor.shape()), dtype=torch.uint8, device=device)
        feed_ndarray(tensor, pixels, cuda_stream=torch.cuda.current_stream(device))
    else:
        pixels = torch.from_numpy(np.array(tensor))
    return pixels.permute(0, 3, 1, 2).to(torch.float32) / 255.0


def _undecodable(paths: list[Path], err: RuntimeError) -> str:
    """The message for a batch DALI failed to decode: the first file PIL cannot decode either, else DALI's line."""
    from PIL import Image

    for path in paths:
        try:
            with Image.open(path) as image:
                image.convert("RGB")
        except Exception as exc:  # noqa: BLE001 -- any decoder failure names the file
            return f"{path} cannot be decoded ({type(exc).__name__}: {exc})"
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and "Error" not in line[:6]]
    return f"DALI cannot decode one of {', '.join(map(str, paths))} ({lines[-1] if lines else 'no reason given'})"


@dataclass(frozen=True)
class ImageFiles:
    """The conditioning image of every row of a prompt dataset (module doc)."""

    paths: tuple[Path, ...]
    """One file per dataset row, in dataset order."""
    source: str
    """The dataset file the rows come from."""

    @classmethod
    def of(cls, dataset: PromptDataset, key: str) -> ImageFiles:
        """The files of ``dataset`` (config key ``key``); UserError naming the row of a missing field or file."""
        base = Path(dataset.source).parent
        paths = []
        for row, record in enumerate(dataset.records, start=1):
            name = record.metadata.get(IMAGE_FIELD)
            if not isinstance(name, str) or not name.strip():
                raise UserError(f"{key}: {dataset.source} row {row} has no '{IMAGE_FIELD}' field (data.images=true "
                                f"needs a conditioning image per row, a path relative to {base})")
            path = base / name
            if not path.is_file():
                raise UserError(f"{key}: image {path} of {dataset.source} row {row} does not exist")
            paths.append(path)
        return cls(tuple(paths), dataset.source)

    def row_of(self, path: Path) -> int:
        """The 1-based row of ``path``."""
        return self.paths.index(path) + 1


class ConditioningImages:
    """The conditioning images of a dataset's prompts, read by an :class:`ImageReader` (module doc)."""

    def __init__(self, files: ImageFiles, reader: ImageReader) -> None:
        self.files, self.reader = files, reader

    def load(self, indices: Sequence[int]) -> torch.Tensor:
        """(len(indices), 3, H, W) float32 in [0, 1]: the images of the prompts at ``indices``; UserError naming
        the file and row of one that cannot be read."""
        paths = [self.files.paths[i] for i in indices]
        try:
            return self.reader.read(paths)
        except (OSError, ValueError) as err:
            named = next((p for p in paths if str(p) in str(err)), None)
            where = f" (row {self.files.row_of(named)} of {self.files.source})" if named is not None else ""
            raise UserError(f"conditioning image: {err}{where}") from None
