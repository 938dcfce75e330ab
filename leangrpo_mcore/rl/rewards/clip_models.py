"""What the learned (CLIP-based) rewards share: loading, device and dtype, tensor preprocessing, batching.

A learned reward loads its model once, in its constructor, from a local directory or file (a Hugging Face hub
id is passed through to ``from_pretrained``); the model is frozen and in eval mode, runs under
``torch.no_grad()`` on option ``device`` (default: the current CUDA device when there is one, else the CPU) in
option ``dtype`` (default: bfloat16 on a GPU, float32 on the CPU), ``batch_size`` images at a time. The
reward object is a plain class, not an ``nn.Module``, so the model never enters a training checkpoint.

Preprocessing equals the model's ``CLIPImageProcessor`` (resize the shortest edge with bicubic filtering,
centre crop, rescale, normalise with the processor config's values) but runs on the float tensor on the
reward's device: the [0, 1] images are first quantised to the 256 levels of the uint8 image a processor
would receive, and the resized image again, as PIL resizes uint8 images to uint8.
"""

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from leangrpo_mcore.errors import UserError, exception_line, require_extra

DEFAULT_BATCH_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# owner/name, as the hub spells a repository; anything else that does not exist is a missing local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_device(device: Optional[str]) -> torch.device:
    """Option ``device``, or the current CUDA device when CUDA is available, else the CPU."""
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise UserError(f"reward.options.device: {device!r} is not a torch device") from None
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_dtype(dtype: Optional[str], device: torch.device) -> torch.dtype:
    """Option ``dtype`` by name, or bfloat16 on an accelerator and float32 on the CPU."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise UserError(f"reward.options.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_batch_size(batch_size: int) -> int:
    """Option ``batch_size`` as a positive int, or UserError."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"reward.options.batch_size must be an integer >= 1, got {batch_size!r}")
    return batch_size


def local_or_hub(key: str, path: Optional[str], download: str, *, hub: bool = True) -> str:
    """``path`` if it exists (or, with ``hub``, looks like a hub id); else UserError naming option ``key`` and
    what to ``download`` ("yuvalkirstain/PickScore_v1 (CLIPModel)")."""
    if not path:
        raise UserError(f"reward.options.{key} is required: download {download} and point reward.options.{key} at it")
    path = os.path.expanduser(str(path))
    if os.path.exists(path) or (hub and _HUB_ID.match(path)):
        return path
    raise UserError(f"reward.options.{key}: {path} does not exist; download {download} "
                    f"and point reward.options.{key} at it")


def _damaged_weight_file(path: str) -> Optional[str]:
    """The first ``*.safetensors`` file in directory ``path`` whose header cannot be read (a truncated or
    overwritten file), or None."""
    if not os.path.isdir(path):
        return None
    from safetensors import safe_open

    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(path, name), framework="pt"):
                    pass
            except Exception:  # noqa: BLE001 -- any failure to read the header marks the damaged file
                return os.path.join(path, name)
    return None


def _from_pretrained(key: str, path: str, download: str, load: Callable[[], Any]) -> Any:
    """``load()``, with any failure to read the files (offline hub id, missing, truncated or damaged files) as
    one UserError line naming the file (a damaged weight file of the directory ``path``, else ``path``)."""
    try:
        return load()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 -- safetensors, pickle and JSON readers raise their own types
        culprit = _damaged_weight_file(path) or path
        raise UserError(f"reward.options.{key}: cannot load {culprit} ({download}): {exception_line(exc)}") from None


def read_state_dict_file(key: str, path: str, download: str) -> Mapping[str, Tensor]:
    """The state dict in the ``torch.save`` file ``path`` (unwrapped from ``{"state_dict": ...}``), loaded with
    ``weights_only``; an unreadable file, or one that holds no state dict, is one UserError line naming it."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- unpickler, zip-reader and EOF errors alike
        raise UserError(f"reward.options.{key}: cannot read {path} ({download}): {exception_line(exc)}") from None
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(value, Tensor) for value in loaded.values()):
        raise UserError(f"reward.options.{key}: {path} does not hold a state dict of tensors; download {download}")
    return loaded


def load_clip_model(key: str, path: str, download: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A frozen ``CLIPModel`` from ``path`` in ``dtype`` on ``device``, in eval mode."""
    transformers = require_extra("transformers", "rewards", "a CLIP-based reward")
    model = _from_pretrained(key, path, download, lambda: transformers.CLIPModel.from_pretrained(path, dtype=dtype))
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(key: str, path: str, download: str) -> Any:
    """The CLIP BPE tokenizer saved in ``path``."""
    transformers = require_extra("transformers", "rewards", "a CLIP-based reward")
    return _from_pretrained(key, path, download, lambda: transformers.CLIPTokenizer.from_pretrained(path))


def pil_bicubic_resize(levels: Tensor, size: Tuple[int, int]) -> Tensor:
    """PIL's bicubic resize of 8-bit images, on float (B, C, H, W) levels in [0, 255]: (B, C, *size) levels.

    PIL's filter widens with the downscale factor (torch's ``antialias=True``) and runs as two passes,
    horizontal then vertical, each rounded and clipped to uint8; one float pass without the intermediate
    rounding lands up to 6 levels away from PIL near sharp edges, these two passes within 1 level on a few
    pixels in 10^4.
    """
    height = levels.shape[-2]
    levels = F.interpolate(levels, size=(height, size[1]), mode="bicubic", align_corners=False, antialias=True)
    levels = levels.round().clamp(0, 255)
    levels = F.interpolate(levels, size=size, mode="bicubic", align_corners=False, antialias=True)
    return levels.round().clamp(0, 255)


@dataclass(frozen=True)
class ImageTransform:
    """A ``CLIPImageProcessor``'s resize, centre crop, rescale and normalisation, on (B, 3, H, W) tensors."""

    shortest_edge: int
    crop_size: Tuple[int, int]
    mean: Tuple[float, float, float]
    std: Tuple[float, float, float]
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_center_crop: bool = True
    do_normalize: bool = True
    round_crop_offset: bool = False
    """Centre-crop offsets rounded, as torchvision's CenterCrop (open_clip), instead of floored (transformers)."""

    @classmethod
    def from_processor(cls, processor: Any) -> "ImageTransform":
        """The transform of a ``CLIPImageProcessor`` (its ``size.shortest_edge``, ``crop_size``, mean, std)."""
        size, crop = dict(processor.size), dict(processor.crop_size)
        if "shortest_edge" not in size:
            raise UserError(f"the image processor resizes to {size}; CLIP rewards need size.shortest_edge")
        if not processor.do_rescale:
            raise UserError("the image processor has do_rescale=false; CLIP rewards expect 8-bit images rescaled")
        return cls(shortest_edge=int(size["shortest_edge"]), crop_size=(int(crop["height"]), int(crop["width"])),
                   mean=tuple(processor.image_mean), std=tuple(processor.image_std),
                   rescale_factor=float(processor.rescale_factor), do_resize=bool(processor.do_resize),
                   do_center_crop=bool(processor.do_center_crop), do_normalize=bool(processor.do_normalize))

    def resized_size(self, height: int, width: int) -> Tuple[int, int]:
        """(height, width) with the shortest edge at ``shortest_edge``, the other scaled and floored (as
        transformers' ``get_resize_output_image_size``)."""
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def center_crop(self, pixels: Tensor) -> Tensor:
        """Crop the centre ``crop_size``, padding with zeros where the image is smaller (as the processor)."""
        crop_h, crop_w = self.crop_size
        height, width = pixels.shape[-2:]
        pad_h, pad_w = max(crop_h - height, 0), max(crop_w - width, 0)
        if pad_h or pad_w:
            top, left = (pad_h + 1) // 2, (pad_w + 1) // 2
            pixels = F.pad(pixels, (left, pad_w - left, top, pad_h - top))
            height, width = pixels.shape[-2:]
        if self.round_crop_offset:
            top, left = int(round((height - crop_h) / 2)), int(round((width - crop_w) / 2))
        else:
            top, left = (height - crop_h) // 2, (width - crop_w) // 2
        return pixels[..., top:top + crop_h, left:left + crop_w]

    def __call__(self, images: Tensor) -> Tensor:
        """Pixel values (B, 3, crop_h, crop_w) float32 of images (B, 3, H, W) in [0, 1]."""
        levels = (images.to(torch.float32) * 255).round().clamp(0, 255)
        if self.do_resize:
            size = self.resized_size(*levels.shape[-2:])
            if size != tuple(levels.shape[-2:]):
                levels = pil_bicubic_resize(levels, size)
        if self.do_center_crop:
            levels = self.center_crop(levels)
        pixels = levels * self.rescale_factor
        if self.do_normalize:
            mean = torch.tensor(self.mean, dtype=torch.float32, device=pixels.device).view(1, 3, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32, device=pixels.device).view(1, 3, 1, 1)
            pixels = (pixels - mean) / std
        return pixels


def load_image_transform(key: str, path: str, download: str) -> ImageTransform:
    """The ``ImageTransform`` of the ``preprocessor_config.json`` in ``path``."""
    transformers = require_extra("transformers", "rewards", "a CLIP-based reward")
    # The PIL flavour reads the same config and needs no torchvision (the default flavour warns without it).
    processor = _from_pretrained(key, path, download,
                                 lambda: transformers.CLIPImageProcessorPil.from_pretrained(path))
    return ImageTransform.from_processor(processor)


def l2_normalise(features: Tensor) -> Tensor:
    """Rows of ``features`` scaled to unit L2 norm."""
    return features / features.norm(p=2, dim=-1, keepdim=True)


class ClipEncoder:
    """A frozen ``CLIPModel`` with its image transform and tokenizer: projected embeddings of a batch."""

    def __init__(self, model: Any, transform: ImageTransform, tokenizer: Any, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model, self.transform, self.tokenizer = model, transform, tokenizer
        self.device, self.dtype = device, dtype
        self.max_length = int(model.config.text_config.max_position_embeddings)

    def pixel_values(self, images: Tensor) -> Tensor:
        """Model input (B, 3, h, w) in the model dtype on its device, of images (B, 3, H, W) in [0, 1]."""
        return self.transform(images.to(self.device)).to(self.dtype)

    def text_inputs(self, prompts: Sequence[str]) -> dict:
        """Token ids and attention mask, padded to the longest prompt, truncated to the context length."""
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        return {"input_ids": tokens["input_ids"].to(self.device),
                "attention_mask": tokens["attention_mask"].to(self.device)}

    def image_embeddings(self, images: Tensor) -> Tensor:
        """Projected image features (B, D) float32, L2-normalised."""
        output = self.model.get_image_features(pixel_values=self.pixel_values(images))
        return l2_normalise(output.pooler_output.to(torch.float32))

    def text_embeddings(self, prompts: Sequence[str]) -> Tensor:
        """Projected text features (B, D) float32, L2-normalised."""
        output = self.model.get_text_features(**self.text_inputs(prompts))
        return l2_normalise(output.pooler_output.to(torch.float32))

    def logit_scale(self) -> Tensor:
        """``exp(logit_scale)`` as a float32 scalar."""
        return self.model.logit_scale.detach().to(torch.float32).exp()


class BatchedReward:
    """A learned reward: ``__call__`` scores ``batch_size`` images at a time with ``score`` under no_grad."""

    batch_size: int = DEFAULT_BATCH_SIZE

    def score(self, images: Tensor, prompts: List[str]) -> Tensor:
        """Rewards (b,) of one chunk of at most ``batch_size`` images."""
        raise NotImplementedError

    def __call__(self, images: Tensor, prompts: List[str]) -> Tensor:
        """Rewards (B,) float32 on the CPU of images (B, 3, H, W) in [0, 1] and their prompts."""
        with torch.no_grad():
            parts = [self.score(images[start:start + self.batch_size], prompts[start:start + self.batch_size])
                     for start in range(0, len(prompts), self.batch_size)]
        return torch.cat(parts).to(torch.float32).cpu()


def load_clip_encoder(path: Optional[str], processor_path: Optional[str], download: str, processor_download: str,
                      device: Optional[str], dtype: Optional[str], *, tokenizer: bool = True) -> ClipEncoder:
    """A ``ClipEncoder`` of the ``CLIPModel`` in ``path`` and the tokenizer (unless not ``tokenizer``) + image
    processor config in ``processor_path`` (default ``path``); ``download`` / ``processor_download`` name what
    to fetch."""
    model_path = local_or_hub("path", path, download)
    key = "processor_path" if processor_path else "path"
    processor_path = local_or_hub(key, processor_path or model_path, processor_download)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    model = load_clip_model("path", model_path, download, torch_device, torch_dtype)
    transform = load_image_transform(key, processor_path, processor_download)
    bpe = load_tokenizer(key, processor_path, processor_download) if tokenizer else None
    return ClipEncoder(model, transform, bpe, torch_device, torch_dtype)
